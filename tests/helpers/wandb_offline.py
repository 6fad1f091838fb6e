"""A W&B offline run read back from its own record, the ``run-ID.wandb`` file: what the run logged, independent
of the code that logged it.

wandb 0.31 ships no Python reader for this file (its Go core writes it), so it is read here by its format: a
7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB-log records in 32 KiB blocks (a record header of
CRC-32 over type byte + payload, length, type FULL / FIRST / MIDDLE / LAST; a block's tail of under 7 bytes is
zero padding), each record one ``wandb_internal_pb2.Record`` (wandb's own protobuf). Every checksum is verified.
"""

import dataclasses
import glob
import json
import os
import struct
import zlib

BLOCK = 32768
HEADER = struct.Struct("<4sHB")  # ident, magic, version
RECORD = struct.Struct("<IHB")   # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclasses.dataclass
class OfflineRun:
    name: str
    project: str
    config: dict     # key: value (JSON-decoded)
    history: dict    # key: [(step, value)], in the order logged
    summary: dict    # key: its final value


def _payloads(data: bytes):
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = HEADER.size, None
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # the block's zero-padded tail
            pos += left
            continue
        crc, length, kind = RECORD.unpack_from(data, pos)
        payload = data[pos + RECORD.size:pos + RECORD.size + length]
        assert len(payload) == length and zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"bad record at {pos}"
        pos += RECORD.size + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
        else:
            raise AssertionError(f"record type {kind} at {pos}")


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def read_offline_run(wandb_file: str) -> OfflineRun:
    """The run, history and summary of one ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    run = OfflineRun("", "", {}, {}, {})
    with open(wandb_file, "rb") as f:
        data = f.read()
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.project = record.run.display_name, record.run.project
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            for key, value in row.items():
                run.history.setdefault(key, []).append((row["_step"], value))
        elif kind == "summary":
            run.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
    return run


def offline_runs(directory) -> list[str]:
    """The ``.wandb`` files of the offline runs under ``directory`` (wandb.init's ``dir``), oldest first."""
    return sorted(glob.glob(os.path.join(str(directory), "wandb", "offline-run-*", "run-*.wandb")))
