"""The fixed layout of a run directory, so stages chain without the user passing paths.

```
workdir/
  backbone/   HF model dir + tokenizer (model=tiny only)
  distill/    datasets Arrow shards + manifest.json
  train/      trainer checkpoints (resumable)
  heads/      final heads (FasterDecoding layout) + calibration.json + medusa_choices.json
              (+ backbone/ after training=medusa2: the trained backbone, or its LoRA adapter)
  export/     medusa/  vllm/  medusa_choices.json  README.md  (+ backbone/ after medusa2, LoRA merged)
  eval/       report.json  report.md  plots/*.png  generations.jsonl
```
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from medusa_train.errors import UserError


@dataclass(frozen=True)
class Workdir:
    root: Path

    @property
    def backbone(self) -> Path:
        return self.root / "backbone"

    @property
    def distill(self) -> Path:
        return self.root / "distill"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def heads(self) -> Path:
        return self.root / "heads"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def eval(self) -> Path:
        return self.root / "eval"


def require(path: Path, what: str, stage: str) -> Path:
    """Fail with a message naming the stage to run first when ``path`` does not exist."""
    if not path.exists():
        raise UserError(
            f"{what} not found at {path}: run `python -m medusa_train stage={stage}` first (same workdir=)"
        )
    return path
