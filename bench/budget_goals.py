"""Cost-model view of issue 9's goals: the budget's best predicted speed-up over plain decoding for a
per-depth acceptance a (all depths), alone and with a 16-token retrieved chain of acceptance s, from
the cost curves the newest calibration cached (one thread count; the draft curve of the head whose
directory path contains HEAD, if given).

    python bench/budget_goals.py ~/.cache/aerie/costs 1 ['smollm2-135m-eagle|']   # 1 torch thread; HEAD ends
                                                                  # with '|' to match one directory exactly
"""
import glob, json, os, sys
from services.spec.acceptance import MAX_LEVELS, prior_stats
from services.spec.budget import build_budget
from services.spec.cost import CostCurve, CostModel

curves, used = {}, {}
threads = sys.argv[2] if len(sys.argv) > 2 else "1"
head = sys.argv[3] if len(sys.argv) > 3 else ""
for f in sorted(glob.glob(sys.argv[1] + "/*.json"), key=os.path.getmtime, reverse=True):  # newest first
    d = json.load(open(f))
    fields = d["key"].split("|")
    role = fields[1]
    if f"threads={threads}" not in fields or role in curves or (role == "draft" and head not in d["key"]):
        continue
    curves[role], used[role] = d["costs"], d["key"]
for role, key in sorted(used.items()):
    print(f"{role}: {key}")
costs = CostModel(CostCurve.from_dict(curves["verify"]), CostCurve.from_dict(curves["draft"]["head"]),
                  CostCurve.from_dict(curves["draft"]["logits"]))
b = build_budget(costs, None, None, True, True)
plain = 1 / costs.t_verify(1)
print("t_verify(1..8) / t_verify(1):", [round(costs.t_verify(r) / costs.t_verify(1), 2) for r in (1, 2, 3, 4, 6, 8)])
print("t_draft(1) / t_verify(1):", round(costs.t_draft(1) / costs.t_verify(1), 3))
for a in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
    s = prior_stats({"top1_agreement": a}); s.depth = [a] * MAX_LEVELS
    p = b.plan(s, 0)
    row = f"a={a:.1f}: eagle {p.rate / plain:.2f}x ({'plain' if p.tree is None else (p.tree.top_k, p.tree.depth, p.tree.size)})"
    for sa in (0.5, 0.7, 0.9):
        s.chain = [sa] * MAX_LEVELS
        q = b.plan(s, 16)
        row += f" | +16-token chain s={sa}: {q.rate / plain:.2f}x (chain {q.chain})"
    print(row)
