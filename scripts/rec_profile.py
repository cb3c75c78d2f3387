"""One call of chosen recurrence kernels of a GRU grid build (`tvmseq bench persistent_gru --build DIR`), for ncu:
    ncu -k regex:rec_ ... python3 scripts/rec_profile.py out/pgru11 float32_uni_h1024_b64 [SUFFIX ...]"""
import json
import sys
from pathlib import Path

import torch
import tvm

out = Path(sys.argv[1])
index = {e["suffix"]: e for e in json.loads((out / "index.json").read_text())["configs"]}
SEQ = 6
for sfx in sys.argv[2:]:
    e = index[sfx]
    D, B, H = 2 if e["bidirectional"] else 1, e["batch"], e["hidden"]
    dt = getattr(torch, e["dtype"])
    mod = tvm.runtime.load_module(str(out / e["file"]))
    ts = [torch.randn(D, SEQ, B, 3 * H, device="cuda"), (torch.rand(D, 3 * H, H, device="cuda") * 0.06 - 0.03).to(dt),
          torch.zeros(D, H, device="cuda"), torch.full((B,), SEQ, dtype=torch.int32, device="cuda"),
          torch.zeros(D, B, H, device="cuda"), torch.empty(SEQ, D, B, H, device="cuda", dtype=dt),
          torch.empty(D, B, H, device="cuda", dtype=dt)]
    mod[f"rec_{sfx}"](*[tvm.runtime.from_dlpack(t) for t in ts])
    torch.cuda.synchronize()
    print(sfx, "ok")
