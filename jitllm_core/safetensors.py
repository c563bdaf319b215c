"""Hugging Face model folder reader: config.json plus *.safetensors shards, tensors memory-mapped.

Exposes the same `tensors` / `raw(name)` / TensorInfo interface as GGUFFile, so the model builder
does not care which format it got.
"""

import json
import mmap
import os
import struct

import numpy as np

from .errors import ModelFileError
from .gguf import GGML_TYPE_IDS, TensorInfo

_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 * 1024 * 1024  # the limit the safetensors format itself sets
INDEX_NAME = "model.safetensors.index.json"


def read_json(path):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise ModelFileError(path, f"cannot read: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(path, f"invalid JSON: {e}") from e


class SafetensorsFolder:
    """An HF model folder: `config` (config.json), `tensors` (name -> TensorInfo), `raw(name)` bytes."""

    def __init__(self, path):
        self.path = str(path)
        config_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelFileError(self.path, "missing config.json (not a Hugging Face model folder)")
        self.config = read_json(config_path)
        if not isinstance(self.config, dict):
            raise ModelFileError(config_path, "config.json must hold a JSON object")

        weight_map = self._weight_map()
        files = sorted(set(weight_map.values())) if weight_map else sorted(
            f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ModelFileError(self.path, "no *.safetensors files")

        self.tensors, self._data = {}, {}
        for file in files:
            self._load(os.path.join(self.path, file))
        for name, file in weight_map.items():
            if name not in self.tensors:
                raise ModelFileError(os.path.join(self.path, file),
                                     f"tensor {name!r} listed in {INDEX_NAME} is not in this file")

    def _weight_map(self):
        index_path = os.path.join(self.path, INDEX_NAME)
        if not os.path.isfile(index_path):
            return {}
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelFileError(index_path, "no 'weight_map' object")
        for file in weight_map.values():
            # the index is untrusted: shards must be plain file names inside the folder
            if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
                raise ModelFileError(index_path, f"invalid shard file name {file!r}")
        return weight_map

    def _load(self, file):
        try:
            with open(file, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ModelFileError(file, "truncated file: too small for a safetensors header")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(file, f"cannot read: {e.strerror or e}") from e
        size = len(mm)
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ModelFileError(file, f"bad header length {n} (file has {size} bytes)")
        try:
            header = json.loads(mm[8:8 + n].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(file, f"invalid JSON header: {e}") from e
        if not isinstance(header, dict):
            raise ModelFileError(file, "header must be a JSON object")

        data = np.frombuffer(mm, dtype=np.uint8)
        data_start = 8 + n
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            info = self._tensor_info(file, name, entry, data_start, size)
            if name in self.tensors:
                raise ModelFileError(file, f"duplicate tensor name {name!r} (also in another shard)")
            self.tensors[name], self._data[name] = info, data

    @staticmethod
    def _tensor_info(file, name, entry, data_start, size):
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(shape)
            if not all(isinstance(d, int) and d >= 0 for d in shape + (begin, end)):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise ModelFileError(file, f"tensor {name!r}: malformed header entry") from None
        if dtype not in _ITEMSIZE:
            raise ModelFileError(file, f"tensor {name!r} has unsupported dtype {dtype!r} (supported: F32, F16, BF16)")
        nbytes = _ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        if end - begin != nbytes:
            raise ModelFileError(file, f"tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                                       f"its shape {list(shape)} x {dtype} needs {nbytes}")
        if data_start + end > size:
            raise ModelFileError(file, f"tensor {name!r}: data (bytes {data_start + begin}..{data_start + end}) "
                                       f"lies beyond the end of the file ({size} bytes)")
        return TensorInfo(name, shape, GGML_TYPE_IDS[dtype], dtype, data_start + begin, nbytes)

    def raw(self, name):
        """The tensor's bytes as a read-only uint8 view of its mapped shard (no copy)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(self.path, f"no tensor named {name!r}")
        return self._data[name][info.offset:info.offset + info.nbytes]
