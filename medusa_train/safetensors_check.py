"""The safetensors header/size check: every tensor's shape read from a file's header, and the file
checked to hold every byte the header announces, without reading the data.

A truncated download, a killed copy or a foreign file (a torch pickle under a ``.safetensors`` name)
fails here with one line naming the file, before ``safetensors.torch.load_file`` or transformers
would fail with a less telling error (or map a short file). Used for the heads' weights, the
backbone's weights and the trainer's checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from medusa_train.errors import HeadsFormatError


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors file's header, checking that the file holds all the
    bytes the header announces (a truncated or foreign file fails here without reading the data).

    Raises:
        HeadsFormatError: missing, unreadable, not safetensors (e.g. a pickle), or truncated.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size or n > 100 << 20:
                raise HeadsFormatError(
                    f"cannot read {path}: truncated, or not a safetensors file ({size} bytes)"
                )
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise HeadsFormatError(f"cannot read {path}: it is missing") from None
    except OSError as err:
        raise HeadsFormatError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, RecursionError):  # the header is no JSON, or nested deeper than the parser goes
        raise HeadsFormatError(
            f"cannot read {path}: truncated, or not a safetensors file (its header does not parse)"
        ) from None
    if not isinstance(header, dict):
        raise HeadsFormatError(f"cannot read {path}: not a safetensors file (its header is not an object)")
    shapes, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise HeadsFormatError(
                f"cannot read {path}: damaged (tensor '{name}' has no valid shape/offsets)"
            ) from None
    if 8 + n + end != size:
        raise HeadsFormatError(
            f"cannot read {path}: truncated or damaged ({size} bytes, its header says {8 + n + end})"
        )
    return shapes
