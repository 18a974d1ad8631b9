"""Replay the latency benchmark's predraw stream: per tree, warmup 1 + repeats 3 calls from Generator(seed+1),
the timed 3 kept; z of mean tau vs 1 + mean C_p for the benchmark's own generator seed and 40 others."""
import statistics, math, torch
from functools import partial
from transformers import AutoModelForCausalLM
from impl.tev.drafter import BlockDrafter
from impl.tev.latency import _realized_trees
from impl.tev.exit_law import target_coverage
from impl.tev.verify import predraw_follow, tev
from impl.workloads.prompts import read_prompts
torch.set_num_threads(2)
target = AutoModelForCausalLM.from_pretrained("models/smollm2", dtype=torch.float32).eval()
drafter = BlockDrafter.load("models/tev/smollm2/base", target)
prompts = [p["input_ids"] for p in read_prompts("results/workloads/smollm2/mt_bench.jsonl") if p.get("input_ids")][:4]
trees = []
with torch.inference_mode():
    for tree, probs, cache, pl in _realized_trees(target, drafter, prompts, 64, 6, 1.0, 30, 8, torch.Generator().manual_seed(1234)):
        trees.append((tree, probs.clone(), float(target_coverage(tree.parents, tree.tokens, probs)), tree.plan()))
cp = statistics.mean(t[2] for t in trees)
def z_of(gseed, f):
    g = torch.Generator().manual_seed(gseed); dev = []; taus = []
    for tree, probs, c, plan in trees:
        for k in range(4):
            tau = len(f(tree.parents, tree.tokens, probs, g, validate=False, plan=plan)[0])
            if k: dev.append(tau - 1 - c); taus.append(tau)
    return statistics.mean(taus), statistics.mean(dev) / (statistics.stdev(dev) / math.sqrt(len(dev)))
with torch.inference_mode():
    print("mean C_p", cp, "benchmark stream predraw 1235:", z_of(1235, predraw_follow), "tev 1238:", z_of(1238, tev))
    print("multinomial 1236:", z_of(1236, partial(predraw_follow, sampler="multinomial")))
    zs = [z_of(s, predraw_follow)[1] for s in range(1, 41)]
    print("predraw z over generator seeds 1..40: mean %.2f sd %.2f max %.2f min %.2f" % (statistics.mean(zs), statistics.stdev(zs), max(zs), min(zs)))
    zt = [z_of(s, tev)[1] for s in range(1, 41)]
    print("tev z over generator seeds 1..40: mean %.2f sd %.2f max %.2f min %.2f" % (statistics.mean(zt), statistics.stdev(zt), max(zt), min(zt)))
