"""One launch of chosen sweep variants (scripts/pmma_sweep.py build), for ncu:
    ncu -k regex:m_gru_16_d1_b256 --section SpeedOfLight ... python3 scripts/pmma_profile.py out/pmma_sweep NAME [NAME...]"""
import json
import sys
from pathlib import Path

import torch
import tvm

out = Path(sys.argv[1])
index = {e["name"]: e for e in json.loads((out / "index.json").read_text())}
mod = tvm.runtime.load_module(str(out / "sweep.so"))
SEQ = 10
for name in sys.argv[2:]:
    e = index[name]
    D, B, H = e["D"], e["B"], e["H"]
    NG = 1 if e.get("cell") == "rnn" else 3
    dt = getattr(torch, e.get("dtype", "float16"))
    ts = [torch.randn(D, SEQ, B, NG * H, device="cuda"), (torch.rand(D, NG * H, H, device="cuda") * 0.06 - 0.03).to(dt),
          torch.zeros(D, H, device="cuda"), torch.full((B,), SEQ, dtype=torch.int32, device="cuda"),
          torch.zeros(D, B, H, device="cuda"), torch.empty(SEQ, D, B, H, device="cuda", dtype=dt),
          torch.empty(D, B, H, device="cuda", dtype=dt)]
    mod[name](*[tvm.runtime.from_dlpack(t) for t in ts])
    torch.cuda.synchronize()
    print(name, "ok")
