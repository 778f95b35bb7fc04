"""Per-example gradients and per-example activations in one vmap, with funhooks.

Run: python examples/per_example_grads.py
"""

import torch
from torch import nn

import funhooks as fh

BATCH, FEATURES, CLASSES = 8, 5, 3


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    f = fh.functional(model, fh.outputs("1"))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, fh.Record]:
        out, rec = f(p, x[None])
        return nn.functional.cross_entropy(out, y[None]), rec

    x, y = torch.randn(BATCH, FEATURES), torch.randint(CLASSES, (BATCH,))
    grads, rec = torch.func.vmap(torch.func.grad(loss, has_aux=True), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    active = (rec["1"]["output"] > 0).float().mean(dim=(1, 2))
    print("per-example gradient norms:", [round(v, 3) for v in norms.tolist()])
    print("per-example fraction of active ReLUs:", [round(v, 3) for v in active.tolist()])

    saliency = fh.activation_grads(model, "0", lambda out: out.max())
    _, arec = torch.func.vmap(saliency)(x)
    print("d max-logit / d hidden, shape:", tuple(arec["0"]["grad"].shape))
    fh.testing.assert_no_hooks(model)


if __name__ == "__main__":
    main()
