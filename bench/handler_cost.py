"""Cost of an iteration handler firing every 50 iterations, fused (mlp-tiny, side by side).

Run: python bench/handler_cost.py
"""

import jax
import numpy as np
import optax

import fuseloop as fl

rng = np.random.default_rng(0)
D, H, C, B, N = 24, 32, 10, 32, 100
X = rng.normal(size=(N, B, D)).astype(np.float32)
Y = rng.integers(0, C, (N, B)).astype(np.int32)
batches = [(X[i], Y[i]) for i in range(N)]
model = fl.models.mlp([H, C])
base = fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-3))
seen = []
withh = base.handle_event(
    "iteration_completed", lambda s: seen.append(s.metrics["loss"]), {"every": 50}
)
v = model.init(jax.random.PRNGKey(0), X[0])
cfg = {}
for K in [32, 100]:
    cfg[f"K={K}"] = lambda K=K: base.run(batches, v, fuse=K, epochs=11)
    cfg[f"K={K}+h"] = lambda K=K: withh.run(batches, v, fuse=K, epochs=11)
for f in cfg.values():
    f()
res = {k: [] for k in cfg}
for _ in range(10):
    for k, f in cfg.items():
        s = f()
        t = [s.times[e] for e in range(1, 11)]
        res[k].append(np.median(t) / N * 1e6)
for k, v_ in res.items():
    print(f"{k:10s} median {np.median(v_):7.1f} min {np.min(v_):7.1f} us/iter")
