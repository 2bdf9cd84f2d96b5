"""``scripts/pubmedqa_paired.py``: paired means and bootstrap intervals from eval JSONL files."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pubmedqa_paired.py"


def write(path: Path, scores: list[tuple[float, float]]) -> Path:
    path.write_text("".join(json.dumps({"id": str(i), "score": {"accuracy": a, "bleu": b}}) + "\n"
                            for i, (a, b) in enumerate(scores)))
    return path


def rows(*files: Path) -> list[list[str]]:
    r = subprocess.run([sys.executable, str(SCRIPT), *map(str, files), "--resamples", "2000"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [[c.strip() for c in line.strip("|").split("|")] for line in r.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| decoder")]


def test_paired_means_and_intervals(tmp_path):
    base = write(tmp_path / "ar.jsonl", [(1, 2.0), (0, 2.0), (1, 2.0), (0, 2.0)])
    # every question's BLEU exactly 0.9x the baseline's: the ratio has no spread however resampled
    scaled = write(tmp_path / "scaled.jsonl", [(1, 1.8), (1, 1.8), (1, 1.8), (0, 1.8)])
    same, other = rows(base, scaled)
    assert same[2:] == ["50.0", "+0.0 [+0.0, +0.0]", "2.00", "1.000 [1.000, 1.000]"]
    assert other[2] == "75.0" and other[3].startswith("+25.0 [") and other[4:] == ["1.80", "0.900 [0.900, 0.900]"]
    lo, hi = (float(x) for x in other[3].split("[")[1].rstrip("]").split(","))
    # one question differs (+25 points each time a resample holds it): Binomial(4, 1/4) has
    # P(0) = 0.32 and P(>= 3) = 0.051, so the 2.5% and 97.5% quantiles are 0 and 3 copies
    assert (lo, hi) == (0.0, 75.0)


def test_files_of_other_questions_are_refused(tmp_path):
    base = write(tmp_path / "ar.jsonl", [(1, 2.0), (0, 2.0)])
    fewer = write(tmp_path / "fewer.jsonl", [(1, 2.0)])
    r = subprocess.run([sys.executable, str(SCRIPT), str(base), str(fewer)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "1 questions, 1 shared with the baseline's 2" in r.stderr
