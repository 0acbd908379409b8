"""Acceptance of the speculative drafters on real code edits, on the CPU, with a perfect verifier.

    python bench/spec_acceptance.py OUT.json [--cache DIR] [--max-pairs N] [--max-file-tokens T]

No trained full-size model runs here, so the target's output is taken as known: the new version of a file.
Corpus: consecutive sdist releases of a few pure-Python packages, downloaded from PyPI at run time into
`--cache` (outside the repository; default ~/.cache/onecard/spec_corpus); every .py file present in both
releases whose text changed is one pair. Tokens: the bundled onecard-tiny-coder tokenizer (Qwen BPE) and
its chat template. Three workloads per pair:
- edit: user turn = the old file + "rewrite it as in release B"; output = the whole new file (fenced);
- diff: an agent turn: a read_file tool call whose result is the old file (cat output); output = the
  unified diff old -> new;
- tool: the same agent prompt; output = str_replace tool calls (Qwen3-Coder's XML tool-call format, values
  raw) quoting each changed hunk's old and new lines.
Greedy speculative decoding is simulated with a perfect verifier: the prefill emits the first output token;
then each verify step asks the drafter for up to k tokens given prompt + output so far, accepts the longest
prefix that equals the true continuation, and emits accepted + 1 tokens. Requests run one after another
through one drafter per (method, k), each finished before the next starts (suffix keeps their outputs).

JSON (argv[1]):
  meta: {date, machine, python, tokenizer, command, packages: {name: [versions]}, pairs, prompt_tokens,
         output_tokens: {workload: n}}
  Times are CPU time of the calling thread (time.thread_time), so that other processes on a shared
  machine do not inflate them; "us" = microseconds.
  results: list of {workload, method, vllm_method, params, k, requests, steps, emitted, draft_tokens, accepted,
         mean_acceptance_length (emitted / steps: tokens per verify step, the bonus token included),
         acceptance_rate (accepted / draft_tokens), nonempty_draft_fraction, us_per_step_mean,
         us_per_step_p99, accepted_hist, steps_by_draft_len}
    method = "<workload>:<label>" (label: ngram, ngram[2-5], ngram[1-3], suffix), unique per row group so
      that a loader keyed by method (bench/spec_verify_project.py) keeps workloads and settings apart;
      vllm_method + params = the `--speculative-config` that ran.
    accepted_hist[a] = verify steps whose first a draft tokens were accepted (a in 0..k; steps with an
      empty draft count under a = 0);
    steps_by_draft_len[d][a] = the same, split by the draft length d the step carried (string keys, only
      non-zero entries): a step verifies 1 + d tokens and emits a + 1 — the cost model's input.
  long_prompt: list of {method, params, prompt_tokens, observe_chunk, observe_us_per_chunk_mean,
         observe_us_per_chunk_max, observe_us_per_token, propose_us_mean, propose_us_p99} — a 64k-token
         prompt (concatenated corpus files) indexed in prefill-sized chunks, then 300 proposals while its
         output re-quotes it.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import itertools
import json
import platform
import random
import statistics
import sys
import tarfile
import time
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from onecard.core.spec.drafter import make_drafter

PACKAGES = {"requests": 3, "attrs": 3, "click": 3, "packaging": 3, "rich": 3}  # name -> release pairs
MODEL_DIR = Path(__file__).resolve().parent.parent / "onecard" / "data" / "onecard-tiny-coder"
KS = (1, 2, 3, 4, 5, 6, 8)
METHODS: list[tuple[str, dict]] = [
    ("ngram", {}),  # vLLM's defaults: prompt_lookup_min = max = 5
    ("ngram", {"prompt_lookup_min": 2, "prompt_lookup_max": 5}),
    ("ngram", {"prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    ("suffix", {}),  # depth 24, 10,000 cached requests, spec factor 1.0, min token prob 0.1
]


# -- corpus ------------------------------------------------------------------------------------------------
def _releases(name: str, pairs: int) -> list[tuple[str, str]]:
    """The newest `pairs + 1` final releases with an sdist: [(version, sdist url)], oldest first."""
    from packaging.version import InvalidVersion, Version

    index = f"https://pypi.org/pypi/{name}/json"
    with urllib.request.urlopen(index, timeout=60) as resp:
        info = json.load(resp)
    found = []
    for ver, files in info["releases"].items():
        try:
            v = Version(ver)
        except InvalidVersion:
            continue
        sdists = [f for f in files if f["packagetype"] == "sdist" and not f.get("yanked")]
        if not v.is_prerelease and not v.is_devrelease and sdists:
            found.append((v, ver, urllib.parse.urljoin(index, sdists[0]["url"])))
    found.sort()
    return [(ver, url) for _, ver, url in found[-(pairs + 1) :]]


def _python_files(archive: Path) -> dict[str, str]:
    """{path inside the release, top folder stripped: text} for every .py file of an sdist."""
    out: dict[str, str] = {}
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            items = [(n, lambda n=n: z.read(n)) for n in z.namelist()]
            return {n.split("/", 1)[1]: read().decode("utf-8", "replace") for n, read in items
                    if n.endswith(".py") and "/" in n}
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            if m.isfile() and m.name.endswith(".py") and "/" in m.name:
                out[m.name.split("/", 1)[1]] = t.extractfile(m).read().decode("utf-8", "replace")
    return out


def load_corpus(cache: Path) -> tuple[dict[str, list[str]], list[dict]]:
    cache.mkdir(parents=True, exist_ok=True)
    versions: dict[str, list[str]] = {}
    pairs: list[dict] = []
    for name, n_pairs in PACKAGES.items():
        rels = _releases(name, n_pairs)
        versions[name] = [v for v, _ in rels]
        files = []
        for ver, url in rels:
            path = cache / url.rsplit("/", 1)[1]
            if not path.exists():
                tmp = path.with_suffix(".part")
                with urllib.request.urlopen(url, timeout=120) as resp:
                    tmp.write_bytes(resp.read())
                tmp.rename(path)
            files.append((ver, _python_files(path)))
        for (va, fa), (vb, fb) in itertools.pairwise(files):
            for rel in sorted(set(fa) & set(fb)):
                if fa[rel] != fb[rel]:
                    pairs.append({"package": name, "old_version": va, "new_version": vb, "path": rel,
                                  "old": fa[rel], "new": fb[rel]})
    return versions, pairs


# -- requests ----------------------------------------------------------------------------------------------
READ_TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Print a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
EDIT_TOOL = {"type": "function", "function": {
    "name": "str_replace", "description": "Replace old_str by new_str in a file.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
        "required": ["path", "old_str", "new_str"]}}}


def build_requests(tok, pair: dict) -> dict[str, tuple[str, str]]:
    """{workload: (prompt text, output text)} for one file pair."""
    path, old, new = pair["path"], pair["old"], pair["new"]
    what = f"{pair['package']} {pair['old_version']} -> {pair['new_version']}"
    edit_prompt = tok.apply_chat_template(
        [{"role": "system", "content": "You are a careful coding assistant."},
         {"role": "user", "content": f"Here is `{path}`:\n```python\n{old}```\n\nUpdate it as in {what} "
                                     "and print the whole new file."}],
        tokenize=False, add_generation_prompt=True)
    agent_prompt = tok.apply_chat_template(
        [{"role": "system", "content": "You are a coding agent working in a repository."},
         {"role": "user", "content": f"Port `{path}` to {what}."},
         {"role": "assistant", "content": "",
          "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}]},
         {"role": "tool", "content": old}],
        tools=[READ_TOOL, EDIT_TOOL], tokenize=False, add_generation_prompt=True)
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(old_lines, new_lines, f"a/{path}", f"b/{path}"))
    calls = []
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        # quote one line of context on each side, as an agent does to make old_str unique
        a0, b0 = max(0, a0 - 1), max(0, b0 - 1)
        a1, b1 = min(len(old_lines), a1 + 1), min(len(new_lines), b1 + 1)
        calls.append(
            "<tool_call>\n<function=str_replace>\n<parameter=path>\n" + path + "\n</parameter>\n"
            "<parameter=old_str>\n" + "".join(old_lines[a0:a1]) + "</parameter>\n"
            "<parameter=new_str>\n" + "".join(new_lines[b0:b1]) + "</parameter>\n</function>\n</tool_call>")
    end = "<|im_end|>"
    return {"edit": (edit_prompt, f"```python\n{new}```{end}"),
            "diff": (agent_prompt, f"```diff\n{diff}```{end}"),
            "tool": (agent_prompt, "\n".join(calls) + end)}


class Prefix:
    """tokens[:n] without copying: the drafter must not see the future."""

    def __init__(self, tokens: list[int], n: int):
        self.tokens, self.n = tokens, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            return self.tokens[start:stop:step]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.tokens[i]


def simulate(workload: str, method: str, params: dict, k: int,
             reqs: list[tuple[list[int], list[int]]]) -> dict:
    drafter = make_drafter(method, k, **params)
    hist = [[0] * (k + 1) for _ in range(k + 1)]
    times: list[float] = []
    steps = emitted = drafted = accepted = nonempty = 0
    for r, (prompt, out) in enumerate(reqs):
        rid = f"req{r}"
        seq = prompt + out
        drafter.observe(rid, Prefix(seq, len(prompt)))
        pos = 1  # the prefill's sampled token
        while pos < len(out):
            view = Prefix(seq, len(prompt) + pos)
            t0 = time.thread_time()
            draft = drafter.propose(rid, view, k)
            times.append(time.thread_time() - t0)
            acc = 0
            truth = out[pos : pos + len(draft)]
            while acc < len(truth) and draft[acc] == truth[acc]:
                acc += 1
            gain = min(acc + 1, len(out) - pos)
            steps += 1
            emitted += gain
            drafted += len(draft)
            accepted += acc
            nonempty += bool(draft)
            hist[len(draft)][acc] += 1
            pos += gain
        drafter.finish(rid, seq)
    times.sort()
    return {"method": f"{workload}:{label(method, params)}", "vllm_method": method, "params": params, "k": k,
            "requests": len(reqs), "steps": steps,
            "emitted": emitted, "draft_tokens": drafted, "accepted": accepted,
            "mean_acceptance_length": emitted / steps if steps else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "nonempty_draft_fraction": nonempty / steps if steps else 0.0,
            "us_per_step_mean": 1e6 * statistics.fmean(times) if times else 0.0,
            "us_per_step_p99": 1e6 * times[int(0.99 * (len(times) - 1))] if times else 0.0,
            **hist_fields(hist)}


def label(method: str, params: dict) -> str:
    if not params:
        return method
    return f"{method}[{params['prompt_lookup_min']}-{params['prompt_lookup_max']}]"


def hist_fields(hist: list[list[int]]) -> dict:
    """accepted_hist and steps_by_draft_len from hist[d][a] (see the module docstring)."""
    return {"accepted_hist": [sum(row[a] for row in hist) for a in range(len(hist))],
            "steps_by_draft_len": {str(d): {str(a): c for a, c in enumerate(row) if c}
                                   for d, row in enumerate(hist) if any(row)}}


def long_prompt(method: str, params: dict, tokens: list[int], out: list[int], chunk: int = 2048) -> dict:
    """Index a 64k-token prompt chunk by chunk (as prefill would), then propose while re-quoting it."""
    drafter = make_drafter(method, 8, **params)
    seq = tokens + out
    chunk_us = []
    for end in range(chunk, len(tokens) + chunk, chunk):
        t0 = time.thread_time()
        drafter.observe("long", Prefix(seq, min(end, len(tokens))))
        chunk_us.append(1e6 * (time.thread_time() - t0))
    prop_us = []
    for pos in range(1, len(out)):
        t0 = time.thread_time()
        drafter.propose("long", Prefix(seq, len(tokens) + pos), 8)
        prop_us.append(1e6 * (time.thread_time() - t0))
    prop_us.sort()
    return {"method": method, "params": params, "prompt_tokens": len(tokens), "observe_chunk": chunk,
            "observe_us_per_chunk_mean": statistics.fmean(chunk_us),
            "observe_us_per_chunk_max": max(chunk_us),
            "observe_us_per_token": sum(chunk_us) / len(tokens),
            "propose_us_mean": statistics.fmean(prop_us),
            "propose_us_p99": prop_us[int(0.99 * (len(prop_us) - 1))]}


def markdown(doc: dict) -> str:
    """The tables BENCHMARKS.md shows, from a result JSON."""
    rows = ["| workload | method | " + " | ".join(f"k={k}" for k in KS) + " | drafter CPU µs/step (k=8) |",
            "| --- | --- | " + " | ".join("---" for _ in KS) + " | --- |"]
    by = {}
    for r in doc["results"]:
        by.setdefault((r["workload"], label(r["vllm_method"], r["params"])), {})[r["k"]] = r
    for (workload, name), per_k in by.items():
        cells = [f"{per_k[k]['mean_acceptance_length']:.2f} ({per_k[k]['acceptance_rate']:.2f}, "
                 f"{per_k[k]['nonempty_draft_fraction']:.2f})" for k in KS]
        last = per_k[KS[-1]]
        rows.append(f"| {workload} | {name} | " + " | ".join(cells)
                    + f" | {last['us_per_step_mean']:.0f} mean, {last['us_per_step_p99']:.0f} p99 |")
    rows += ["", ("| method (64k-token prompt) | observe µs/token | ms per 2048-token chunk (mean / max) "
                  "| propose µs mean / p99 |"), "| --- | --- | --- | --- |"]
    for r in doc["long_prompt"]:
        name = label(r["method"], r["params"])
        rows.append(f"| {name} | {r['observe_us_per_token']:.1f} | {r['observe_us_per_chunk_mean'] / 1e3:.1f} / "
                    f"{r['observe_us_per_chunk_max'] / 1e3:.1f} | {r['propose_us_mean']:.0f} / "
                    f"{r['propose_us_p99']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--table", action="store_true", help="print the markdown tables of an existing OUT and exit")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "onecard" / "spec_corpus")
    ap.add_argument("--max-pairs", type=int, default=60)
    ap.add_argument("--max-file-tokens", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(args.out.read_text())))
        return

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    versions, pairs = load_corpus(args.cache)
    print(f"{len(pairs)} changed .py files across {sum(len(v) - 1 for v in versions.values())} release pairs")

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    random.Random(args.seed).shuffle(pairs)
    chosen, workloads = [], {"edit": [], "diff": [], "tool": []}
    for pair in pairs:
        if len(chosen) >= args.max_pairs:
            break
        if not 30 <= len(ids(pair["old"])) <= args.max_file_tokens or len(ids(pair["new"])) > args.max_file_tokens:
            continue
        chosen.append(pair)
        for name, (prompt, out) in build_requests(tok, pair).items():
            workloads[name].append((ids(prompt), ids(out)))
    print(f"{len(chosen)} pairs used; output tokens: "
          + ", ".join(f"{w} {sum(len(o) for _, o in r)}" for w, r in workloads.items()))

    results = []
    for workload, reqs in workloads.items():
        for method, params in METHODS:
            for k in KS:
                res = {"workload": workload, **simulate(workload, method, params, k, reqs)}
                results.append(res)
                print(f"{workload:5} {method:6} {json.dumps(params):48} k={k} "
                      f"len {res['mean_acceptance_length']:.2f} rate {res['acceptance_rate']:.2f} "
                      f"nonempty {res['nonempty_draft_fraction']:.2f} "
                      f"{res['us_per_step_mean']:.0f}/{res['us_per_step_p99']:.0f} us", flush=True)

    # 64k-token prompt: concatenated old files; the output re-quotes the last file with its edit.
    big: list[int] = []
    for pair in pairs:
        big += ids(f"# file: {pair['path']}\n{pair['old']}\n")
        if len(big) >= 65536:
            break
    big = big[:65536]
    out = ids(chosen[0]["new"])[:600]
    longp = [long_prompt(m, p, big, out) for m, p in METHODS]
    for row in longp:
        print(f"64k prompt {row['method']:6} {json.dumps(row['params']):48} observe "
              f"{row['observe_us_per_token']:.1f} us/token ({row['observe_us_per_chunk_mean'] / 1e3:.1f} ms per "
              f"{row['observe_chunk']}-token chunk), propose {row['propose_us_mean']:.0f}/"
              f"{row['propose_us_p99']:.0f} us")

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.node()}".strip(),
        "python": sys.version.split()[0], "tokenizer": "onecard/data/onecard-tiny-coder",
        "command": " ".join(["python", *sys.argv]),
        "packages": versions, "pairs": [f"{p['package']} {p['old_version']}->{p['new_version']} {p['path']}"
                                        for p in chosen],
        "prompt_tokens": {w: sum(len(p) for p, _ in r) for w, r in workloads.items()},
        "output_tokens": {w: sum(len(o) for _, o in r) for w, r in workloads.items()},
    }
    doc = {"meta": meta, "results": results, "long_prompt": longp}
    args.out.write_text(json.dumps(doc, indent=1))
    print(markdown(doc))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
