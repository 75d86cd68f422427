#!/usr/bin/env python3
"""Generate the student starters (stages/) from the solutions (solutions/).

A solution marks the code a stage asks for:

    /* BEGIN SOLUTION: what the student writes (HANDOUT.md#stage-03) */
    ...code...
    /* END SOLUTION */

For stage NN, regions tagged stage-NN become a TODO stub that stops the run
with a message naming the TODO (hw_todo, exit status 3); regions tagged with
another stage keep their code (stage N's starter contains the earlier stages'
solutions) and lose only their marker lines.

    tools/make_starters.py            write stages/NN_name/{hw_fsdp.c,README.md}
    tools/make_starters.py --check    exit 1 (and say which file) if stages/ is out of date
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = re.compile(r"^(?P<indent>\s*)/\* BEGIN SOLUTION: (?P<what>.*) \(HANDOUT\.md#stage-(?P<stage>\d\d)\) \*/\s*$")
END = re.compile(r"^\s*/\* END SOLUTION \*/\s*$")

# What each stage's README says (kept here so the READMEs are generated too).
STAGES = {
    "01": ("Blocking forward",
           "Shard every parameter into a DTensor and run the forward: unshard (copy-in, all-gather, copy-out) "
           "before each module, reshard (free) after it. Everything on the compute stream.",
           "fsdp_init (sharding), unshard, reshard",
           "loss parity (forward only), DTensor mesh/placement/shards, params freed after each forward, peak memory"),
    "02": ("Full training step",
           "Unshard again in backward, reduce-scatter the grads with an average into sharded grads, free the "
           "unsharded grads and params, global grad norm with an all-reduce, clipping and AdamW on the shards.",
           "fsdp_pre_backward, fsdp_post_backward (reduce_grads), fsdp_optimizer_step",
           "loss and grad-norm parity, grads freed after reduce-scatter, params freed after backward, peak memory"),
    "03": ("Forward overlap",
           "Move the all-gathers to their own stream, order them with events, and prefetch the next module's "
           "params while the current one computes, keeping at most two modules unsharded.",
           "stream/event creation in fsdp_init, issue_all_gather, wait_all_gather, fsdp_pre_forward, "
           "the shards_ready event in fsdp_optimizer_step",
           "parity, all-gathers overlap compute in the trace, peak memory bound"),
    "04": ("Backward overlap",
           "Prefetch in backward (reverse forward order), reduce-scatter on its own stream overlapping the "
           "backward, and make the optimizer wait for the last reduce-scatter.",
           "reduce-scatter stream/events in fsdp_init, reduce_grads, fsdp_pre_backward, fsdp_finish_backward",
           "parity, overlap in forward and backward, memory"),
    "05": ("Activation checkpointing",
           "With --ac the loop calls the forward hooks again inside backward. Keep a training state per module "
           "so that a recompute does not all-gather twice or reshard before the backward.",
           "the training-state checks in fsdp_pre_forward, fsdp_post_forward, fsdp_pre_backward, "
           "fsdp_finish_backward",
           "parity with --ac, two all-gathers per module per step, activation memory lower than stage 04"),
    "06": ("ZeRO-2",
           "With --reshard-after-forward=false keep the params unsharded from forward to backward: no "
           "all-gather at all in backward; free them in post_backward.",
           "fsdp_post_forward",
           "parity, zero all-gathers in backward, params kept after forward, memory as expected"),
}


def convert(text, stage, src_name):
    out, stack, todos = [], [], []
    for lineno, line in enumerate(text.split("\n"), 1):
        m = BEGIN.match(line)
        if m:
            if stack:
                raise SystemExit(f"{src_name}:{lineno}: nested BEGIN SOLUTION")
            stub = m.group("stage") == stage
            stack.append(stub)
            if stub:
                ind, what = m.group("indent"), m.group("what")
                where = f"HANDOUT.md#stage-{stage}"
                todos.append(what)
                out.append(f"{ind}/* TODO(stage {stage}): {what}. */")
                c_what = what.replace("\\", "\\\\").replace('"', '\\"')
                out.append(f'{ind}hw_todo("{c_what}", "{where}");')
            continue
        if END.match(line):
            if not stack:
                raise SystemExit(f"{src_name}:{lineno}: END SOLUTION without BEGIN")
            stack.pop()
            continue
        if stack and stack[-1]:
            continue  # solution code of this stage: dropped
        out.append(line)
    if stack:
        raise SystemExit(f"{src_name}: BEGIN SOLUTION without END")
    if not todos:
        raise SystemExit(f"{src_name}: no BEGIN SOLUTION region tagged stage-{stage}")
    banner = (f"/* STARTER for stage {stage} — this is your file. Fill every TODO(stage {stage}) below\n"
              f" * (each one stops the run until you do; see HANDOUT.md#stage-{stage}).\n"
              f" * Generated from the instructors' solution by tools/make_starters.py. */\n")
    return banner + "\n".join(out), todos


def readme(stage, dirname, todos):
    title, goal, hooks, checks = STAGES[stage]
    lines = [f"# Stage {stage} — {title}", "", goal, "",
             f"**Your file:** `stages/{dirname}/hw_fsdp.c`. **What to fill:** {hooks}.", "",
             "The TODOs in it:", ""]
    lines += [f"- {t}" for t in todos]
    lines += ["", f"**Graded on:** {checks}. Run `make grade STAGE={stage}`; details in "
              f"[HANDOUT.md](../../HANDOUT.md#stage-{stage}).", ""]
    return "\n".join(lines)


def main():
    check = "--check" in sys.argv[1:]
    sol_root, stage_root = os.path.join(ROOT, "solutions"), os.path.join(ROOT, "stages")
    if not os.path.isdir(sol_root):
        print("no solutions/ here (the student tree): nothing to generate or check")
        return 0
    stale = []
    for d in sorted(os.listdir(sol_root)):
        m = re.match(r"(\d\d)_", d)
        if not m or not os.path.isfile(os.path.join(sol_root, d, "hw_fsdp.c")):
            continue
        stage = m.group(1)
        src = os.path.join(sol_root, d, "hw_fsdp.c")
        with open(src) as fh:
            starter, todos = convert(fh.read(), stage, src)
        wanted = {"hw_fsdp.c": starter, "README.md": readme(stage, d, todos)}
        for name, content in wanted.items():
            path = os.path.join(stage_root, d, name)
            have = open(path).read() if os.path.exists(path) else None
            if have == content:
                continue
            if check:
                stale.append(os.path.relpath(path, ROOT))
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    fh.write(content)
                print(f"wrote {os.path.relpath(path, ROOT)}")
    if check and stale:
        print("stages/ is out of date with solutions/ (run tools/make_starters.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
