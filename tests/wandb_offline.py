"""Read what an offline W&B run recorded (run-<id>.wandb), so tests can check it without a server.

The file is W&B's transaction log: a 7-byte header (":W&B", then version bytes), then LevelDB-style
blocks of 32 KiB holding records with a 7-byte header each (CRC-32, length, type: full, first, middle,
last), every record a serialised `wandb_internal_pb2.Record`.
"""

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path):
    """The Record messages of one .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # the rest of a block too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record


def offline_run(path: Path) -> dict:
    """{"id", "group", "name", "config": {key: value}, "history": [{key: value}], "summary": {key: value}}."""
    run = {"history": [], "config": {}, "summary": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, group=record.run.run_group, name=record.run.display_name)
            run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            run["history"].append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                                   for item in record.history.item})  # fmt: skip
        elif kind == "summary":
            for item in record.summary.update:
                run["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run
