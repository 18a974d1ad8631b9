"""Cor. 1 per tree: on the latency benchmark's own realised trees (seed S, B = 64, T = 1), draw K verifier
calls per tree for predraw (cdf, all draws), predraw (visited draws), TEV; compare each tree's mean tau with
1 + C_p(tree) and pool. Usage: python pertree.py SEED NTREES K OUT.json"""
import json, sys, statistics, math
import torch

from impl.tev.drafter import BlockDrafter
from impl.tev.latency import _realized_trees
from impl.tev.exit_law import target_coverage
from impl.tev.verify import predraw_follow, tev
from impl.workloads.prompts import read_prompts
from functools import partial

seed, n_trees, K, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained("models/smollm2", dtype=torch.float32).eval()
drafter = BlockDrafter.load("models/tev/smollm2/base", target)
prompts = [p["input_ids"] for p in read_prompts("results/workloads/smollm2/mt_bench.jsonl") if p.get("input_ids")][:4]
arms = {"predraw_all": partial(predraw_follow, draws="all"), "predraw_visited": partial(predraw_follow, draws="visited"),
        "tev": tev}
gens = {n: torch.Generator().manual_seed(10_000 * seed + i) for i, n in enumerate(arms)}
gen = torch.Generator().manual_seed(seed)
rows = []
with torch.inference_mode():
    for t_i, (tree, probs, cache, prefix_len) in enumerate(_realized_trees(target, drafter, prompts, 64, 6, 1.0, n_trees, 8, gen)):
        cp = float(target_coverage(tree.parents, tree.tokens, probs))
        row = {"tree": t_i, "cp": cp, "n": len(tree)}
        plan = tree.plan()
        for name, f in arms.items():
            taus = [len(f(tree.parents, tree.tokens, probs, gens[name], validate=False, plan=plan)[0]) for _ in range(K)]
            m = statistics.mean(taus); sd = statistics.stdev(taus)
            row[name] = {"mean": m, "z": (m - 1 - cp) / (sd / math.sqrt(K)) if sd > 0 else 0.0}
        rows.append(row)
        print(t_i, round(cp, 4), {n: (round(row[n]["mean"] - 1 - cp, 4), round(row[n]["z"], 2)) for n in arms}, flush=True)
summ = {}
for name in arms:
    zs = [r[name]["z"] for r in rows]
    dev = [r[name]["mean"] - 1 - r["cp"] for r in rows]
    summ[name] = {"mean_dev": statistics.mean(dev), "sum_z_over_sqrt_n": sum(zs) / math.sqrt(len(zs)),
                  "n_abs_z_gt_3": sum(abs(z) > 3 for z in zs)}
print(json.dumps(summ, indent=1))
json.dump({"rows": rows, "summary": summ}, open(out, "w"))
