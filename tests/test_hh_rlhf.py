"""HH-RLHF loader: parses the shared test split and reports malformed lines by number."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from harness.data.hh_rlhf import ASSISTANT, load_hh_rlhf

# the shared data folder lies beside the checkout (../shared), in CI too
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
needs_shared = pytest.mark.skipif(not SHARED.is_file(), reason=f"{SHARED} not present")


@needs_shared
def test_shared_file_parses_into_prompts_replies_and_pairs():
    data = load_hh_rlhf(SHARED)
    assert data.lines == 2312
    assert len(data.examples) + len(data.malformed) == data.lines  # nothing dropped silently
    # Five lines of this split really do have chosen/rejected dialogues that part before the
    # last assistant turn; they must be reported, with their line numbers.
    assert [m.line for m in data.malformed] == [1255, 1689, 1951, 1953, 2037]
    assert all("prompts differ" in m.reason for m in data.malformed)

    with gzip.open(SHARED, "rt", encoding="utf-8") as fh:
        first = json.loads(fh.readline())
    ex = data.examples[0]
    assert ex.line == 1
    assert ex.prompt.endswith(ASSISTANT) and ex.prompt.startswith("\n\nHuman:")
    assert ex.prompt + ex.chosen == first["chosen"]  # prompt + reply rebuilds the dialogue exactly
    assert ex.prompt + ex.rejected == first["rejected"]
    assert ASSISTANT not in ex.chosen  # the reply is the LAST assistant turn only
    assert data.sft_pairs[0] == (ex.prompt, ex.chosen)
    assert all(p.endswith(ASSISTANT) for p in data.prompts)

    train, evals = data.split_prompts(100, seed=1)
    assert len(evals) == 100 and not set(train) & set(evals)
    assert len(train) + len(evals) == len(data.prompts)
    assert data.split_prompts(100, seed=1) == (train, evals)
    assert "2312 lines, 2307 usable, 5 malformed" in data.summary()
    assert "line 1255:" in data.summary()


def _dialogue(human: str, reply: str) -> str:
    return f"\n\nHuman: {human}{ASSISTANT} {reply}"


def _write(path: Path, lines: list[str], gz: bool) -> Path:
    blob = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(blob) if gz else blob)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_malformed_lines_are_reported_with_line_numbers(tmp_path, gz):
    good = json.dumps({"chosen": _dialogue("hi", "hello!"), "rejected": _dialogue("hi", "go away")})
    lines = [
        good,                                                                      # 1 ok
        '{"chosen": "unterminated',                                                # 2 bad JSON
        json.dumps({"chosen": _dialogue("hi", "x")}),                              # 3 missing rejected
        json.dumps({"chosen": "\n\nHuman: hi", "rejected": "\n\nHuman: hi"}),      # 4 no assistant turn
        json.dumps({"chosen": _dialogue("hi", "a"), "rejected": _dialogue("yo", "b")}),  # 5 prompts differ
        json.dumps(["chosen", "rejected"]),                                        # 6 not an object
        "",                                                                        # 7 empty
        json.dumps({"chosen": 3, "rejected": _dialogue("hi", "b")}),               # 8 not a string
        good,                                                                      # 9 ok
    ]
    # The file name says .jsonl even when gzipped: the loader must sniff the bytes.
    data = load_hh_rlhf(_write(tmp_path / "hh.jsonl", lines, gz))
    assert data.lines == 9
    assert [e.line for e in data.examples] == [1, 9]
    assert data.examples[0].chosen == " hello!" and data.examples[0].rejected == " go away"
    reasons = {m.line: m.reason for m in data.malformed}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 8]
    assert "not valid JSON" in reasons[2]
    assert "missing key 'rejected'" in reasons[3]
    assert "no '\\n\\nAssistant:' turn" in reasons[4]
    assert "prompts differ" in reasons[5]
    assert "not a JSON object" in reasons[6]
    assert "empty line" in reasons[7]
    assert "'chosen' is not a string" in reasons[8]
    text = data.summary()
    assert "9 lines, 2 usable, 7 malformed" in text
    assert "line 2: not valid JSON" in text and "line 5: chosen and rejected prompts differ" in text


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_hh_rlhf(tmp_path / "nope.jsonl")


def _good_line(i: int = 0) -> str:
    return json.dumps({"chosen": _dialogue(f"hi {i}", "hello!"), "rejected": _dialogue(f"hi {i}", "go away")})


def test_bad_files_name_the_file_and_what_is_wrong(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.jsonl.*empty"):
        load_hh_rlhf(empty)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="binary.jsonl.*no usable line"):
        load_hh_rlhf(binary)
    # a .gz cut in the middle: the error names the file and the last line read
    whole = _write(tmp_path / "whole.jsonl.gz", [_good_line(i) for i in range(400)], True).read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut.jsonl.gz.*unreadable after line \d+.*truncated"):
        load_hh_rlhf(cut)


def test_byte_order_mark_is_not_part_of_line_one(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (_good_line(1) + "\n" + _good_line(2) + "\n").encode())
    data = load_hh_rlhf(p)
    assert [e.line for e in data.examples] == [1, 2] and not data.malformed


def test_too_few_prompts_to_hold_out_eval_prompts_is_an_error(tmp_path):
    from harness.config import load_config
    from harness.data import load_source

    p = _write(tmp_path / "few.jsonl", [_good_line(i) for i in range(5)], False)
    cfg = load_config(overrides={"data.source": "hh_rlhf", "data.hh_path": str(p)})
    with pytest.raises(ValueError, match="5 distinct prompts; at least 10"):
        load_source(cfg)
    cfg = load_config(overrides={"data.source": "hh_rlhf", "data.hh_path": str(p), "data.eval_prompts": 0})
    assert len(load_source(cfg).train_prompts) == 5
