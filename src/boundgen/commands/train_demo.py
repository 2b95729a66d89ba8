"""boundgen train-demo: rebuild the built-in demo model (catalog, tokenizer, tiny Qwen2), CPU."""

from __future__ import annotations

HELP = (
    "train the built-in demo model on the synthetic catalog (CPU, minutes); writes an HF checkpoint"
)


def add_arguments(p) -> None:
    p.add_argument("--out", default="boundgen-demo-model", help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--lr", type=float, default=2e-3)
    # NOTE: 2 threads is the shipped recipe (8.6 min of training on an idle 2-core machine). On a
    # CPU
    # shared with other processes, OpenMP spin-waiting made 2 threads 20x slower than 1: use
    # --threads 1
    # or OMP_WAIT_POLICY=PASSIVE there.
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (see the note above)")
    p.add_argument("--num-items", type=int, default=3000)
    p.add_argument("--lm-weight", type=float, default=0.0, help="auxiliary next-token loss weight")
    p.add_argument(
        "--pack", action="store_true", help="all candidates of a query in one relevance sequence"
    )
    p.add_argument(
        "--aux-weight",
        type=float,
        default=1.0,
        help="weight of the per-attribute match flags in relevance training",
    )
    p.add_argument("--rel-batch", type=int, default=128, help="relevance sequences per step")
    p.add_argument(
        "--rel-weight", type=float, default=2.0, help="weight of the relevance label loss"
    )
    p.add_argument(
        "--eval-limit",
        type=int,
        default=100,
        help="held-out examples per task evaluated at the end",
    )
    p.add_argument(
        "--eval-every", type=int, default=200, help="quick held-out relevance AUC every N steps"
    )
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--device", default="cpu", help="torch device (the shipped model is trained on cpu)"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        help="stop early after this much training time (the result is then not reproducible)",
    )


def run(args) -> int:
    from pathlib import Path

    from boundgen.demo.train import train

    train(
        Path(args.out),
        seed=args.seed,
        steps=args.steps,
        lr=args.lr,
        threads=args.threads,
        num_items=args.num_items,
        max_minutes=args.max_minutes,
        lm_weight=args.lm_weight,
        device=args.device,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        pack_relevance=args.pack,
        rel_batch=args.rel_batch,
        aux_weight=args.aux_weight,
        rel_weight=args.rel_weight,
        eval_limit=args.eval_limit,
        eval_every=args.eval_every,
    )
    return 0
