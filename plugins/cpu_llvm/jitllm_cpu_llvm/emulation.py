"""Programs of a CPU with instructions this one lacks, made runnable here: each x86 intrinsic the lowering may call
for such a CPU, where this one has not the features it needs, becomes a function of plain LLVM IR with the
instruction's documented semantics (Intel's), which LLVM compiles for any x86 (a 16-lane vector as two or four of
this CPU's), or, where this CPU has AVX2, a function of AVX2's instructions (whose code LLVM generates far faster).
So the programs an AVX-512 VNNI machine runs -- their lanes, loops, prefetches and dots -- run and are checked on an
AVX2 one (`assembly.device`), slowly."""
import re

from jitllm_core.errors import BackendError

# intrinsic -> the feature sets that give it (any one of them)
NEEDS = {
    "llvm.x86.avx512.vpdpbusd.512": [{"avx512vnni"}],
    "llvm.x86.avx512.vpdpbusd.256": [{"avx512vnni", "avx512vl"}, {"avxvnni"}],
    "llvm.x86.avx512.permvar.sf.512": [{"avx512f"}],
    "llvm.x86.avx512.pmaddubs.w.512": [{"avx512bw"}],
    "llvm.x86.avx512.pmaddw.d.512": [{"avx512bw"}],
    "llvm.x86.avx512.pshuf.b.512": [{"avx512bw"}],
}
DECLARE = re.compile(r'^declare (\S+(?: x \w+>)?) @"(llvm\.x86\.[\w.]+)"\((.*)\)$', re.M)


def emulated(text, host_features):
    """Module text with each intrinsic of NEEDS that host_features (names) cannot give defined in plain IR, or by
    AVX2's instructions where the host has them (AVX2_BODIES)."""
    has = set(host_features)
    for ret, name, params in DECLARE.findall(text):
        if name not in NEEDS and name.startswith("llvm.x86.avx512.") and "avx512f" not in has:
            raise BackendError(f"cpu: no emulation of {name} for this CPU (without AVX-512): add it to emulation.py")
        if name not in NEEDS or any(need <= has for need in NEEDS[name]):
            continue
        types = [p.rsplit(" ", 1)[0] for p in params.split(", ")]
        own = f'@"emu.{name[len("llvm.x86."):]}"'
        base = name.rsplit(".", 1)[0]
        body = ((AVX2_BODIES.get(base) if "avx2" in has else None) or BODIES[base])(ret, *types)
        text = text.replace(f'declare {ret} @"{name}"({params})',
                            f"define internal {ret} {own}({', '.join(f'{t} %a{i}' for i, t in enumerate(types))}) "
                            f"alwaysinline {{\n{body}\n}}")
        text = text.replace(f'@"{name}"', own)
    for name in sorted(set(re.findall(r"@(llvm\.[\w.]+)\(", text))):  # what the bodies call (names unquoted)
        if not re.search(rf'^declare .*@"?{re.escape(name)}"?\(', text, re.M):
            text += f"\ndeclare {_signature(name)}\n"
    return text


def _signature(name):
    """The declaration, less `declare`, of an intrinsic the bodies call."""
    sat = re.fullmatch(r"llvm\.sadd\.sat\.v(\d+)i16", name)
    if sat:
        v = f"<{sat.group(1)} x i16>"
        return f"{v} @{name}({v}, {v})"
    ret, params = CALLED[name]
    return f"{ret} @{name}({params})"


def _lanes(t):
    """(count, element type) of an IR vector type '<n x ty>'"""
    n, ty = t.strip("<>").split(" x ")
    return int(n), ty


def _pick(n, start, step):
    return "<" + ", ".join(f"i32 {start + step * i}" for i in range(n)) + ">"


def _vpdpbusd(ret, acc, a, b):
    """acc + per lane the sum of 4 products: a's bytes unsigned times b's signed (no saturation)"""
    n, _ = _lanes(ret)
    w = f"<{4 * n} x i32>"
    lines = [f"%ua = bitcast {a} %a1 to <{4 * n} x i8>", f"%sb = bitcast {b} %a2 to <{4 * n} x i8>",
             f"%wa = zext <{4 * n} x i8> %ua to {w}", f"%wb = sext <{4 * n} x i8> %sb to {w}",
             f"%p = mul {w} %wa, %wb"]
    lines += [f"%p{j} = shufflevector {w} %p, {w} poison, <{n} x i32> {_pick(n, j, 4)}" for j in range(4)]
    lines += [f"%s0 = add {ret} %p0, %p1", f"%s1 = add {ret} %p2, %p3", f"%s = add {ret} %s0, %s1",
              f"%r = add {ret} %a0, %s", f"ret {ret} %r"]
    return "\n".join(lines)


def _pairs(ret, a, b, ext_a, add):
    """per lane of ret: the sum of a pair of products of a's and b's elements, widened to ret's elements first"""
    n, ty = _lanes(ret)
    w = f"<{2 * n} x {ty}>"
    lines = [f"%wa = {ext_a} {a} %a0 to {w}", f"%wb = sext {b} %a1 to {w}", f"%p = mul {w} %wa, %wb",
             f"%e = shufflevector {w} %p, {w} poison, <{n} x i32> {_pick(n, 0, 2)}",
             f"%o = shufflevector {w} %p, {w} poison, <{n} x i32> {_pick(n, 1, 2)}"]
    lines += [add.format(ret=ret, n=n), f"ret {ret} %r"]
    return "\n".join(lines)


def _pmaddubsw(ret, a, b):
    """a's bytes unsigned times b's signed, each pair of products added into an i16, saturated"""
    n, _ = _lanes(ret)
    return _pairs(ret, a, b, "zext", "%r = call {ret} @llvm.sadd.sat.v{n}i16({ret} %e, {ret} %o)")


def _pmaddwd(ret, a, b):
    """a's and b's i16 multiplied, each pair of products added into an i32 (wrapping)"""
    return _pairs(ret, a, b, "sext", "%r = add {ret} %e, %o")


def _lanewise(ret, lane):
    """A vector of type ret built lane by lane: lane(i, n) -> (the lines computing lane i, its value's name)."""
    n, ty = _lanes(ret)
    lines, prev = [], "poison"
    for i in range(n):
        body, value = lane(i, n)
        lines += body + [f"%r{i} = insertelement {ret} {prev}, {ty} {value}, i32 {i}"]
        prev = f"%r{i}"
    return "\n".join(lines + [f"ret {ret} {prev}"])


def _permvar(ret, v, idx):
    """lane i of the result: lane idx[i] mod n of v"""
    return _lanewise(ret, lambda i, n: ([
        f"%i{i} = extractelement {idx} %a1, i32 {i}", f"%m{i} = and i32 %i{i}, {n - 1}",
        f"%e{i} = extractelement {v} %a0, i32 %m{i}"], f"%e{i}"))


def _pshufb(ret, v, idx):
    """byte i of the result: 0 where idx's byte i has its top bit set, else byte idx[i] & 15 of v's 16-byte lane
    holding byte i"""
    return _lanewise(ret, lambda i, n: ([
        f"%i{i} = extractelement {idx} %a1, i32 {i}", f"%m{i} = and i8 %i{i}, 15", f"%w{i} = zext i8 %m{i} to i32",
        f"%p{i} = add i32 %w{i}, {i & ~15}", f"%e{i} = extractelement {v} %a0, i32 %p{i}",
        f"%z{i} = icmp slt i8 %i{i}, 0", f"%s{i} = select i1 %z{i}, i8 0, i8 %e{i}"], f"%s{i}"))


def _halves(ret, a, b, fn, half):
    """ret's two halves, each `fn` (the host's instruction, vectors of type `half`) of a's and b's halves"""
    n, _ = _lanes(ret)
    lo, hi = _pick(n // 2, 0, 1), _pick(n // 2, n // 2, 1)
    return "\n".join([f"%a0l = shufflevector {a} %a0, {a} poison, <{n // 2} x i32> {lo}",
                      f"%a0h = shufflevector {a} %a0, {a} poison, <{n // 2} x i32> {hi}",
                      f"%a1l = shufflevector {b} %a1, {b} poison, <{n // 2} x i32> {lo}",
                      f"%a1h = shufflevector {b} %a1, {b} poison, <{n // 2} x i32> {hi}"] + fn("l") + fn("h") + [
        f"%r = shufflevector {half} %rl, {half} %rh, <{n} x i32> {_pick(n, 0, 1)}", f"ret {ret} %r"])


def _vpdpbusd_by_pmaddwd(ret, acc, a, b):
    """vpdpbusd of n lanes by AVX2's pmaddwd: the bytes widened to i16 (exact: 255 x 128 twice fits an i32), each
    pmaddwd's 8 pair sums, then each lane's two pairs added"""
    n, _ = _lanes(ret)
    h = f"<{4 * n} x i16>"
    lines = [f"%ua = bitcast {a} %a1 to <{4 * n} x i8>", f"%sb = bitcast {b} %a2 to <{4 * n} x i8>",
             f"%wa = zext <{4 * n} x i8> %ua to {h}", f"%wb = sext <{4 * n} x i8> %sb to {h}"]
    parts = []
    for q in range(n // 4):
        pick = _pick(16, 16 * q, 1)
        lines += [f"%xa{q} = shufflevector {h} %wa, {h} poison, <16 x i32> {pick}",
                  f"%xb{q} = shufflevector {h} %wb, {h} poison, <16 x i32> {pick}",
                  f"%m{q} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %xa{q}, <16 x i16> %xb{q})"]
        parts.append(f"%m{q}")
    size = 8
    while len(parts) > 1:  # joined two by two into the 2n pair sums
        joined = [f"%j{size}_{k}" for k in range(len(parts) // 2)]
        lines += [f"{out} = shufflevector <{size} x i32> {parts[2 * k]}, <{size} x i32> {parts[2 * k + 1]}, "
                  f"<{2 * size} x i32> {_pick(2 * size, 0, 1)}" for k, out in enumerate(joined)]
        parts, size = joined, 2 * size
    lines += [f"%e = shufflevector <{2 * n} x i32> {parts[0]}, <{2 * n} x i32> poison, <{n} x i32> {_pick(n, 0, 2)}",
              f"%o = shufflevector <{2 * n} x i32> {parts[0]}, <{2 * n} x i32> poison, <{n} x i32> {_pick(n, 1, 2)}",
              f"%s = add {ret} %e, %o", f"%r = add {ret} %a0, %s", f"ret {ret} %r"]
    return "\n".join(lines)


def _pshufb_halves(ret, v, idx):
    """pshufb of 64 bytes as AVX2's of 32 twice: both shuffle within 16-byte lanes"""
    return _halves(ret, v, idx, lambda h: [
        f"%r{h} = call <32 x i8> @llvm.x86.avx2.pshuf.b(<32 x i8> %a0{h}, <32 x i8> %a1{h})"], "<32 x i8>")


def _permvar_halves(ret, v, idx):
    """vpermps of 16 lanes as AVX2's of 8: each half of the result looks its indices up in both halves of v and
    takes the one that bit 3 of the index names"""
    return _halves(ret, v, idx, lambda h: [
        f"%fl{h} = call <8 x float> @llvm.x86.avx2.permps(<8 x float> %a0l, <8 x i32> %a1{h})",
        f"%fh{h} = call <8 x float> @llvm.x86.avx2.permps(<8 x float> %a0h, <8 x i32> %a1{h})",
        f"%b{h} = and <8 x i32> %a1{h}, splat (i32 8)", f"%u{h} = icmp ne <8 x i32> %b{h}, zeroinitializer",
        f"%r{h} = select <8 x i1> %u{h}, <8 x float> %fh{h}, <8 x float> %fl{h}"], "<8 x float>")


BODIES = {"llvm.x86.avx512.vpdpbusd": _vpdpbusd, "llvm.x86.avx512.pmaddubs.w": _pmaddubsw,
          "llvm.x86.avx512.pmaddw.d": _pmaddwd, "llvm.x86.avx512.permvar.sf": _permvar,
          "llvm.x86.avx512.pshuf.b": _pshufb}
# where the host has AVX2, these by its instructions: LLVM's code generation took 78 s for a module of byte lookups
# emulated lane by lane, 12 s for one of dot4s widened to i32 (a few and under 1 s by these)
AVX2_BODIES = {"llvm.x86.avx512.pshuf.b": _pshufb_halves, "llvm.x86.avx512.permvar.sf": _permvar_halves,
               "llvm.x86.avx512.vpdpbusd": _vpdpbusd_by_pmaddwd}
CALLED = {"llvm.x86.avx2.pshuf.b": ("<32 x i8>", "<32 x i8>, <32 x i8>"),  # AVX2_BODIES' instructions
          "llvm.x86.avx2.permps": ("<8 x float>", "<8 x float>, <8 x i32>"),
          "llvm.x86.avx2.pmadd.wd": ("<8 x i32>", "<16 x i16>, <16 x i16>")}
