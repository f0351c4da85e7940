import torch, time
from mtpflow.backends.native import kernel
torch.set_num_threads(2)
def t(f, name):
    for _ in range(20): f()
    s=time.perf_counter()
    for _ in range(300): f()
    print(name, round((time.perf_counter()-s)/300*1e6), "us")
for rows in (1, 9, 13):
    x = torch.randn(rows, 49152) * 3
    t(lambda: (x.argmax(-1), torch.logsumexp(x, -1), x.topk(8, dim=-1)), f"torch argmax+lse+topk8 {rows}")
    t(lambda: kernel.logit_stats(x, 2, top=8), f"native top8 {rows}")
    t(lambda: kernel.logit_stats(x, 2), f"native no-top {rows}")
