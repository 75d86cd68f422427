#!/usr/bin/env python3
"""Write the seed corpora fuzz/corpus/<target>/ (small valid and invalid files).

    /usr/bin/python3 fuzz/make_seeds.py

Deterministic: the same files every time. Standard library only. Each seed is
named after what it is; to add one, add a line below (or drop a file into the
directory by hand) and keep the total small (the corpus lives in the repository).
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def st(header, data=b"", pad=True, header_len=None):
    h = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


def t(shape, begin, end, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


SAFETENSORS = {
    # valid
    "ok_two_tensors": st({"__metadata__": {"format": "pt", "step": "7"}, "tok_embeddings.weight": t([2, 3], 0, 24),
                          "norm.weight": t([3], 24, 36)}, f32(*range(6)) + f32(0.5, -0.25, 1e-20)),
    "ok_scalar_and_empty": st({"s": t([], 0, 4), "e": t([0, 5], 4, 4), "c": t([1, 1, 1, 2], 4, 12)},
                              f32(3.0, 1.0, 2.0)),
    "ok_unpadded": st(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', f32(1, 2), pad=False),
    "ok_escapes": st('{"\\u00e9t\\u00e9 \\ud83d\\ude00 \\"q\\"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                     '"__metadata__":{"k":"v\\n\\t\\\\ \\u00e9"}}'.encode(), f32(7)),
    "ok_unicode_raw": st(json.dumps({"κ.weight": t([1], 0, 4)}, ensure_ascii=False).encode(), f32(1)),
    "ok_no_tensors": st({}),
    "ok_trailing_data": st({"a": t([1], 0, 4)}, f32(1, 2)),
    # invalid: each reaches a different error
    "bad_short": b"\x10\x00\x00\x00",
    "bad_header_len": st({"a": t([2], 0, 8)}, f32(1, 2), header_len=1000),
    "bad_json": st(b'{"a": {"dtype": "F32",, }}'),
    "bad_not_object": st(b"[1, 2, 3]"),
    "bad_f16": st({"a": t([2], 0, 4, "F16")}, b"\0" * 4),
    "bad_no_dtype": st({"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "bad_wrong_size": st({"a": t([2, 3], 0, 12)}, f32(*range(6))),
    "bad_outside": st({"a": t([2, 3], 8, 32)}, f32(*range(6))),
    "bad_reversed": st({"a": t([0], 8, 0)}, f32(*range(6))),
    "bad_overlap": st({"a": t([2, 3], 0, 24), "b": t([3], 16, 28)}, f32(*range(7))),
    "bad_misaligned": st({"a": t([1], 2, 6)}, b"\0" * 8),
    "bad_neg_shape": st({"a": t([-2], 0, 8)}, b"\0" * 8),
    "bad_huge_shape": st({"a": t([4294967296, 4294967296], 0, 8)}, b"\0" * 8),
    "bad_five_dims": st({"a": t([1, 1, 1, 1, 1], 0, 4)}, b"\0" * 4),
    "bad_meta_number": st({"__metadata__": {"step": 3}}),
    "bad_duplicate_key": st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                            b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', f32(1)),
    "bad_deep": st(b"[" * 100 + b"]" * 100),
    "bad_utf8": st(b'{"\xc3\x28":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', f32(1)),
    "bad_surrogate": st(b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', f32(1)),
    "bad_trailing": st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x', f32(1)),
    "bad_offsets_float": st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}', f32(1)),
}


def npy(descr, shape, data, version=(1, 0), fortran=False, header=None):
    if header is None:
        header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (
            descr, fortran, "(%s)" % "".join("%d," % s for s in shape) if len(shape) == 1 else str(tuple(shape)))
    h = header.encode("latin1")
    size_len = 2 if version == (1, 0) else 4
    total = 6 + 2 + size_len + len(h) + 1
    h += b" " * (-total % 64) + b"\n"
    length = struct.pack("<H" if size_len == 2 else "<I", len(h))
    return b"\x93NUMPY" + bytes(version) + length + h + data


TOKENS = {
    # valid
    "ok_text": b"The quick brown fox jumps over the lazy dog.\n" * 2,
    "ok_text_binary": bytes(range(256)),
    "ok_u2": npy("<u2", [40], struct.pack("<40H", *[(i * 7919) % 65536 for i in range(40)])),
    "ok_i4": npy("<i4", [40], struct.pack("<40i", *[(i * 104729) % 100003 for i in range(40)])),
    "ok_v2": npy("<u2", [20], struct.pack("<20H", *range(20)), version=(2, 0)),
    "ok_v3": npy("<i4", [20], struct.pack("<20i", *range(20)), version=(3, 0)),
    "ok_fortran_1d": npy("<u2", [20], struct.pack("<20H", *range(20)), fortran=True),
    # invalid
    "bad_truncated_data": npy("<u2", [40], b"\0" * 30),
    "bad_extra_data": npy("<u2", [4], b"\0" * 10),
    "bad_truncated_header": npy("<u2", [4], b"\0" * 8)[:30],
    "bad_float": npy("<f4", [4], b"\0" * 16),
    "bad_2d": npy("<i4", [2, 2], b"\0" * 16),
    "bad_negative": npy("<i4", [3], struct.pack("<3i", 1, -5, 2)),
    "bad_empty_array": npy("<u2", [0], b""),
    "bad_version": npy("<u2", [2], b"\0" * 4, version=(9, 0)),
    "bad_missing_key": npy("<u2", [3], b"\0" * 6, header="{'descr': '<u2', 'shape': (3,), }"),
    "bad_unknown_key": npy("<u2", [3], b"\0" * 6,
                           header="{'descr': '<u2', 'fortran_order': False, 'shape': (3,), 'x': 1}"),
    "bad_huge_dim": npy("<i4", [0], b"", header="{'descr': '<i4', 'fortran_order': False, "
                                                "'shape': (99999999999999999999999,), }"),
    "bad_magic_only": b"\x93NUMPY",
}


def main():
    for target, seeds in (("safetensors", SAFETENSORS), ("tokens", TOKENS)):
        d = os.path.join(HERE, "corpus", target)
        os.makedirs(d, exist_ok=True)
        for name, data in seeds.items():
            with open(os.path.join(d, name), "wb") as fh:
                fh.write(data)
        print("%s: %d seeds, %d bytes" % (d, len(seeds), sum(len(v) for v in seeds.values())))


if __name__ == "__main__":
    main()
