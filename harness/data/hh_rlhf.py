"""Anthropic HH-RLHF loader: jsonl or jsonl.gz lines of {"chosen": dialogue, "rejected": dialogue}.

A dialogue is a run of "\\n\\nHuman: ..." and "\\n\\nAssistant: ..." turns; chosen and rejected share
everything up to the last assistant turn. From each line:

  prompt   = the dialogue up to and including the last "\\n\\nAssistant:" marker,
  chosen   = the rest of the chosen dialogue (the chosen last reply, leading space kept, so
             prompt + chosen is the original dialogue exactly),
  rejected = the rest of the rejected dialogue.

Malformed lines are never silently dropped: each is kept with its line number and reason.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

ASSISTANT = "\n\nAssistant:"
TURN = re.compile(r"\n\n(Human|Assistant):")


@dataclass(frozen=True)
class HHExample:
    """One well-formed line."""

    line: int
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class Malformed:
    """One line that could not be used, and why."""

    line: int
    reason: str


@dataclass
class HHData:
    """Everything read from one file: the usable examples and the lines that were not."""

    path: str
    lines: int
    examples: list[HHExample] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)

    @property
    def prompts(self) -> list[str]:
        """Distinct prompts in file order."""
        return list(dict.fromkeys(e.prompt for e in self.examples))

    @property
    def sft_pairs(self) -> list[tuple[str, str]]:
        """(prompt, chosen reply) SFT targets."""
        return [(e.prompt, e.chosen) for e in self.examples]

    def split_prompts(self, n_eval: int, seed: int = 0) -> tuple[list[str], list[str]]:
        """(train, eval) distinct prompts; `n_eval` drawn with `seed`, so no eval prompt is trained on."""
        prompts = self.prompts
        if not 0 <= n_eval < len(prompts):
            raise ValueError(f"data.eval_prompts: got {n_eval}; allowed: 0 <= eval prompts < {len(prompts)} "
                             f"(the distinct prompts in {self.path}, some of which must be left to train on)")
        held = set(random.Random(seed).sample(range(len(prompts)), n_eval))
        return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]

    def summary(self, max_listed: int = 20) -> str:
        """Counts, then each malformed line with its number and reason (the first `max_listed`)."""
        out = [f"{self.path}: {self.lines} lines, {len(self.examples)} usable, {len(self.malformed)} malformed"]
        out += [f"  line {m.line}: {m.reason}" for m in self.malformed[:max_listed]]
        if len(self.malformed) > max_listed:
            out.append(f"  ... and {len(self.malformed) - max_listed} more")
        return "\n".join(out)


def split_dialogue(dialogue: str) -> tuple[str, str] | None:
    """(prompt through the last assistant marker, reply after it), or None with no assistant turn."""
    i = dialogue.rfind(ASSISTANT)
    return None if i < 0 else (dialogue[: i + len(ASSISTANT)], dialogue[i + len(ASSISTANT):])


def dialogue_messages(prompt: str) -> list[dict[str, str]]:
    """A prompt as chat messages for a tokenizer's chat template: each "Human:" turn a user message,
    each "Assistant:" turn an assistant message, the final empty assistant marker dropped (the
    template's generation prompt takes its place); text before the first turn joins the first
    message, and text without turns (the embedded world's) is one user message."""
    parts = TURN.split(prompt)
    if len(parts) == 1:
        return [{"role": "user", "content": prompt.strip()}]
    msgs = [{"role": "user" if role == "Human" else "assistant", "content": text.strip()}
            for role, text in zip(parts[1::2], parts[2::2])]
    if msgs[-1]["role"] == "assistant" and not msgs[-1]["content"]:
        msgs.pop()
    if parts[0].strip() and msgs:
        msgs[0]["content"] = f"{parts[0].strip()}\n{msgs[0]['content']}"
    return msgs or [{"role": "user", "content": parts[0].strip()}]


def parse_line(raw: bytes, line: int) -> HHExample | Malformed:
    """Parse one line of the file (1-based `line` for error reports)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Malformed(line, f"not valid UTF-8 ({e.reason} at byte {e.start})")
    if not text.strip():
        return Malformed(line, "empty line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Malformed(line, f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return Malformed(line, f"not a JSON object (got {type(obj).__name__})")
    for key in ("chosen", "rejected"):
        if key not in obj:
            return Malformed(line, f"missing key {key!r} (keys: {sorted(obj)})")
        if not isinstance(obj[key], str):
            return Malformed(line, f"{key!r} is not a string (got {type(obj[key]).__name__})")
    chosen, rejected = split_dialogue(obj["chosen"]), split_dialogue(obj["rejected"])
    for key, half in (("chosen", chosen), ("rejected", rejected)):
        if half is None:
            return Malformed(line, f"no '\\n\\nAssistant:' turn in {key!r}")
    if chosen[0] != rejected[0]:
        at = len(os.path.commonprefix([chosen[0], rejected[0]]))
        return Malformed(line, f"chosen and rejected prompts differ (first difference at character {at})")
    return HHExample(line, chosen[0], chosen[1], rejected[1])


def load_hh_rlhf(path: str | Path) -> HHData:
    """Read an HH-RLHF jsonl / jsonl.gz file."""
    p = Path(path)
    allowed = "allowed: a .jsonl or .jsonl.gz file with 'chosen'/'rejected' dialogues"
    if not p.is_file():
        raise FileNotFoundError(f"HH-RLHF file {str(p)!r}: not found; {allowed}")
    if p.stat().st_size == 0:
        raise ValueError(f"HH-RLHF file {str(p)!r}: the file is empty; {allowed}")
    data = HHData(path=str(p), lines=0)
    try:
        with open(p, "rb") as fh:
            gz = fh.read(2) == b"\x1f\x8b"  # the gzip magic: trust the bytes, not the file name
        with (gzip.open if gz else open)(p, "rb") as fh:
            for data.lines, raw in enumerate(fh, start=1):
                raw = raw.rstrip(b"\r\n")
                if data.lines == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark belongs to the file, not to line 1's JSON
                item = parse_line(raw, data.lines)
                (data.examples if isinstance(item, HHExample) else data.malformed).append(item)  # type: ignore
    except (EOFError, OSError, gzip.BadGzipFile) as e:  # a truncated or corrupt .gz
        raise ValueError(f"HH-RLHF file {str(p)!r}: unreadable after line {data.lines} ({e}); "
                         "the file is truncated or corrupt - download it again") from None
    if not data.examples:
        raise ValueError(f"HH-RLHF file {str(p)!r}: no usable line (is it an HH-RLHF jsonl file?)\n"
                         + data.summary(max_listed=5))
    return data
