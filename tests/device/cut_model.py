#!/usr/bin/env python3
"""Write the default model cut to its first N layers (tokenizer and embedding whole): a file small enough to carry
to an offline GPU machine, where the engine's device paths then run on a real model file.

    python tests/device/cut_model.py OUT [--layers N]
"""
import argparse
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jitllm_core.models import default_model_path  # noqa: E402


def cut(src, out, layers):
    """Write GGUF file src cut to its first `layers` layers (tokenizer, embedding and head whole) to out."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, f.types[0])
    for t in r.tensors:
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    cut(default_model_path(), args.out, args.layers)


if __name__ == "__main__":
    main()
