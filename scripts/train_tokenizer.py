#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of onecard-tiny-coder on the CPython standard library on this machine.

Usage: python scripts/train_tokenizer.py OUT_DIR [--vocab-size 8192] [--max-files N] [--stdlib PATH]

Writes OUT_DIR/tokenizer/ (PreTrainedTokenizerFast: tokenizer.json, tokenizer_config.json with a Qwen-style
chat template) and OUT_DIR/split.json: the stdlib root and the train / held-out file lists. A file is held out
when sha1 of its path relative to the stdlib root falls in bucket 0 of 20, so the split is the same on every
machine that has the file (the list differs only where the stdlib does). Files under site-packages and
dist-packages are not the standard library and are skipped; so are files that are not UTF-8 or over 1 MB.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
HELDOUT_BUCKETS = 20

# Qwen3-style: system/tools block, hermes tool calls, tool responses folded into a user turn, and the empty
# think block when enable_thinking is false.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_BUCKETS == 0


def list_stdlib_files(root: Path, max_bytes: int = 1_000_000) -> list[str]:
    """Relative posix paths of the stdlib's .py files, sorted (deterministic)."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        parts = set(rel.split("/"))
        if parts & {"site-packages", "dist-packages", "__pycache__"} or not p.is_file():
            continue
        if p.stat().st_size > max_bytes or p.stat().st_size == 0:
            continue
        try:
            p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(rel)
    return sorted(out)


def make_split(root: Path, max_files: int | None) -> dict:
    files = list_stdlib_files(root)
    train = [f for f in files if not is_heldout(f)]
    heldout = [f for f in files if is_heldout(f)]
    if max_files:
        # smoke runs: a deterministic thinning that keeps both lists non-empty
        step = max(1, len(train) // max_files)
        train = train[::step][:max_files]
        heldout = heldout[: max(2, max_files // 10)]
    return {"stdlib": str(root), "python": sys.version.split()[0], "heldout_rule":
            f"sha1(relative path) % {HELDOUT_BUCKETS} == 0", "train": train, "heldout": heldout}


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    # the added tokens come on top: keep the total at vocab_size (a round embedding size)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(ADDED_TOKENS), min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=None, bos_token=None, clean_up_tokenization_spaces=False,
                                  model_max_length=131072)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-files", type=int, default=None, help="use only about N training files (smoke runs)")
    ap.add_argument("--stdlib", default=None, help="stdlib folder (default: sysconfig's)")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.stdlib).resolve() if args.stdlib else stdlib_root()
    split = make_split(root, args.max_files)
    (out / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    texts = [(root / f).read_text(encoding="utf-8") for f in split["train"]]
    tok = build_tokenizer(texts, args.vocab_size)
    tok.save_pretrained(out / "tokenizer")
    print(f"tokenizer: {len(tok)} tokens from {len(texts)} files ({sum(map(len, texts)) / 1e6:.1f} M chars), "
          f"{len(split['heldout'])} files held out, {time.time() - t0:.1f}s -> {out / 'tokenizer'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
