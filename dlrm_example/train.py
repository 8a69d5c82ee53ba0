"""Train / evaluate DLRM (or DLRM_DCN) on IBP-compressed or TorchRec tables.

    python -m dlrm_example.train --backend ibp|torchrec [--steps N] [--seed S]
        [--data generated | --data criteo-tsv FILE... | --data criteo-npy DIR]
        [--scale F] [--zipf A] [--multi-hot] [--model dlrm|dcn] [--batch-size B]
        [--lr LR] [--optimizer sgd|adagrad] [--ibp-tables large|all|NAMES]
        [--checkpoint DIR [--resume] [--checkpoint-every N]] [--eval-only] ...
    torchrun --nproc_per_node 2 -m dlrm_example.train ...       # gloo, CPU

The same --seed gives the same data and the same initial weights for both backends;
with the same options the two backends compute the same losses (bit for bit on one
process, see tests/test_dlrm_example.py). The last line printed is

    final: backend=ibp model=dlrm steps=200 train_loss=0.48210000 eval_auc=0.7512 eval_logloss=0.4790

Exit status: 0 done; 2 bad input (data files, checkpoint, options); 3 the loss became
NaN or infinite; 130 interrupted (a checkpoint is written first when --checkpoint is
given; rerun with --resume to continue from it).

Both backends run the model under TorchRec's DistributedModelParallel with the same
plan (dlrm_example.model): the large tables row-wise over the ranks, the others
table-wise; --backend ibp puts the --ibp-tables (by default the large ones) on the IBP
kernel, compressed, and --backend torchrec keeps every table on FBGEMM's fused kernel.
The sparse optimizer is fused into backward (the sharder's fused_params), the dense
part is data-parallel. Multi-process (torchrun, gloo on CPU): --batch-size is the
global batch, each rank trains on its slice and holds its shards only; the trainer
prints each rank's table memory.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint as ckpt
from .data import DataError, DataSource, make_source, rank_slice
from .model import (
    BACKENDS, MODELS, OPTIMIZERS, Built, ModelConfig, build, dense_named_parameters, dense_optimizer,
    resolve_ibp_tables, table_memory,
)

EXIT_BAD_INPUT = 2
EXIT_NAN = 3
EXIT_INTERRUPTED = 130
DEFAULT_LR = {"sgd": 0.1, "adagrad": 0.05}


def quiet_library_warnings() -> None:
    """Silence deprecation notices that torch and TorchRec internals raise on every run
    and that a user of this trainer cannot act on."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torchrec|torch)(\.|$)")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def model_state(built: Built) -> dict:
    """What a checkpoint holds of the model: its state_dict (tables as ShardedTensors) and
    the fused optimizer state, TorchRec's layout for both backends."""
    return {"model": built.module.state_dict(), "optim": built.module.fused_optimizer.state_dict()}


class UserError(Exception):
    """Bad options or input: reported as 'error: ...', exit status 2."""


class NaNLoss(Exception):
    pass


def _int_list(text: str):
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dlrm_example.train",
                                description="DLRM training on IBP-compressed or TorchRec embedding tables.")
    p.add_argument("--backend", choices=BACKENDS, default="ibp")
    p.add_argument("--steps", type=int, default=200, help="training steps in all (a resumed run continues "
                                                          "up to this step)")
    p.add_argument("--seed", type=int, default=0, help="data, hidden model and initial weights")
    p.add_argument("--data", nargs="+", default=["generated"], metavar=("KIND", "PATH"),
                   help="generated | criteo-tsv FILE [FILE...] | criteo-npy DIR")
    p.add_argument("--scale", type=float, default=0.01,
                   help="Criteo Kaggle cardinalities times this (small features keep up to 32 rows)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of generated ids")
    p.add_argument("--multi-hot", action="store_true", help="generated bags of DLRMv2's multi-hot sizes")
    p.add_argument("--model", choices=MODELS, default="dlrm")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--dense-arch", type=_int_list, default=None, help="bottom MLP sizes (default 64,DIM)")
    p.add_argument("--over-arch", type=_int_list, default=[64, 32, 1], help="top MLP sizes, ending with 1")
    p.add_argument("--dcn-layers", type=int, default=2)
    p.add_argument("--dcn-low-rank", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1024, help="global batch size (all ranks)")
    p.add_argument("--lr", type=float, default=None, help="learning rate, dense and sparse "
                                                          "(default 0.1 for sgd, 0.05 for adagrad)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad",
                   help="sgd: EXACT_SGD + torch SGD; adagrad: EXACT_ROWWISE_ADAGRAD + torch Adagrad")
    p.add_argument("--ibp-tables", default="large", metavar="SPEC",
                   help="--backend ibp: the tables on the IBP kernel: large (those with at least 1%% of all "
                        "rows), all, or comma-separated names (t_cat_0,...); the others stay on FBGEMM")
    p.add_argument("--eval-batches", type=int, default=8, help="eval batches of --batch-size")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=500, metavar="N",
                   help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint")
    p.add_argument("--eval-only", action="store_true",
                   help="inference only: evaluate the latest checkpoint (or the initial model)")
    p.add_argument("--max-samples", type=int, default=None, help="criteo-tsv: read at most this many lines")
    p.add_argument("--max-bad-lines", type=int, default=100,
                   help="criteo-tsv: malformed lines tolerated before --max-bad-fraction applies")
    p.add_argument("--max-bad-fraction", type=float, default=0.01,
                   help="criteo-tsv: stop when more than this fraction of the lines read is malformed")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch and libibp)")
    p.add_argument("--report", metavar="FILE", help="write the run's results and every rank's table memory "
                                                    "as JSON (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def model_config(a) -> ModelConfig:
    from .data import scaled_cardinalities

    dim = a.embedding_dim
    cfg = ModelConfig(model=a.model, cardinalities=scaled_cardinalities(a.scale), embedding_dim=dim,
                      dense_arch=list(a.dense_arch or [64, dim]), over_arch=list(a.over_arch),
                      dcn_layers=a.dcn_layers, dcn_low_rank=a.dcn_low_rank)
    cfg.check()
    return cfg


class Run:
    """One training / evaluation run (one process of it)."""

    def __init__(self, a):
        self.a = a
        self.rank, self.world = 0, 1
        self._own_pg = False
        self._tmpdir = None
        self.stop_signal: Optional[int] = None
        self.built: Optional[Built] = None
        self.data: Optional[DataSource] = None
        self.result: dict = {}

    # ---- process group ----
    def init_dist(self):
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            dist.init_process_group("gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self._own_pg = True
        elif not dist.is_initialized():
            # DistributedModelParallel needs a process group even on one process
            self._tmpdir = tempfile.TemporaryDirectory(prefix="dlrm_example_pg_")
            dist.init_process_group("gloo", init_method=f"file://{self._tmpdir.name}/store", rank=0, world_size=1)
            self._own_pg = True
        if self.a.batch_size % self.world:
            raise UserError(f"--batch-size {self.a.batch_size} is not divisible by the {self.world} ranks")

    def close(self):
        import torch.distributed as dist

        if self._own_pg and dist.is_initialized():
            dist.destroy_process_group()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    def log(self, msg: str):
        if self.rank == 0:
            print(msg, flush=True)

    def allreduce_max(self, value: float) -> float:
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    # ---- model ----
    def build(self, cfg: ModelConfig, load_tables: bool) -> Built:
        a = self.a
        try:
            tables = resolve_ibp_tables(cfg, a.ibp_tables)
        except ValueError as e:
            raise UserError(str(e)) from None
        return build(cfg, a.seed, a.backend, a.optimizer, self.lr, world=self.world, ibp_tables=tables,
                     load_tables=load_tables)

    # ---- checkpoints ----
    def meta(self, cfg: ModelConfig) -> dict:
        a = self.a
        return {"backend": a.backend, "model_config": cfg.to_dict(), "optimizer": a.optimizer, "lr": self.lr,
                "world_size": self.world, "seed": a.seed, "batch_size": a.batch_size, "data": a.data,
                "ibp_tables": a.ibp_tables}

    def save(self, built: Built, dense_opt, cfg: ModelConfig, step: int, last_loss: float) -> Path:
        """Tables, fused optimizer state and dense weights through torch.distributed.checkpoint
        (every rank writes its shards), dense optimizer state in dense.pt (rank 0)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        root = Path(self.a.checkpoint)
        tmp = [ckpt.begin(root, step) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(tmp, src=0)
        tmp = Path(tmp[0])
        dcp.save(model_state(built), checkpoint_id=tmp / "model")
        if self.rank == 0:
            ckpt.save_dense(tmp, dense_opt.state_dict() if dense_opt else {}, {"step": step, "last_loss": last_loss})
        self.barrier()
        final = None
        if self.rank == 0:
            final = ckpt.commit(root, tmp, step, self.meta(cfg))
        self.barrier()
        return final if final is not None else root / ckpt.step_name(step)

    def restore(self, built: Built, dense_opt, path: Path, train: bool):
        """Load tables, fused optimizer state and dense weights (resharded to this run's
        ranks), and the dense optimizer state."""
        import torch.distributed.checkpoint as dcp

        state = model_state(built)
        try:
            dcp.load(state, checkpoint_id=path / "model")
            built.module.load_state_dict(state["model"])
            built.module.fused_optimizer.load_state_dict(state["optim"])
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise ckpt.CheckpointError(f"{path}/model: does not fit this model: {e}") from None
        blob = ckpt.load_dense(path)
        if train and dense_opt is not None:
            try:
                dense_opt.load_state_dict(blob["optimizer"])
            except (KeyError, ValueError, RuntimeError) as e:
                raise ckpt.CheckpointError(f"{path}/dense.pt does not fit this model: {e}") from None
        return blob

    # ---- evaluation ----
    def evaluate(self, built: Built, data: DataSource):
        from torchmetrics.functional.classification import binary_auroc

        a = self.a
        lo, hi = rank_slice(a.batch_size, self.rank, self.world)
        preds, labels = [], []
        built.module.eval()
        with torch.no_grad():
            for i in range(a.eval_batches):
                b = data.eval_batch(i, a.batch_size).rows(lo, hi)
                preds.append(built.module(b.dense, b.kjt()).squeeze(-1).float())
                labels.append(b.labels)
        built.module.train()
        logits, y = torch.cat(preds), torch.cat(labels)
        if self.world > 1:
            import torch.distributed as dist

            gl = [torch.zeros_like(logits) for _ in range(self.world)]
            gy = [torch.zeros_like(y) for _ in range(self.world)]
            dist.all_gather(gl, logits)
            dist.all_gather(gy, y)
            logits, y = torch.cat(gl), torch.cat(gy)
        auc = float(binary_auroc(torch.sigmoid(logits), y.long()))
        logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, y))
        return auc, logloss

    # ---- memory ----
    def rank_memory(self, built: Built) -> list:
        """table_memory of every rank (gathered)."""
        m = table_memory(built)
        if self.world == 1:
            return [m]
        import torch.distributed as dist

        every = [None] * self.world
        dist.all_gather_object(every, m)
        return every

    @staticmethod
    def memory_lines(backend: str, every: list) -> list:
        """One line per rank: the table shards it holds."""
        mib = 2 ** 20
        lines = []
        for r, m in enumerate(every):
            line = f"table memory, rank {r}: {m['raw'] / mib:.2f} MiB raw"
            if backend == "ibp":
                line += (f", held {(m['ibp'] + m['fbgemm']) / mib:.2f} MiB (IBP {m['ibp'] / mib:.2f} MiB for "
                         f"{m['ibp_raw'] / mib:.2f} MiB raw, packed {m['ibp_packed'] / mib:.2f}; FBGEMM "
                         f"{m['fbgemm'] / mib:.2f})")
            lines.append(line + f", optimizer state {m['optimizer_state'] / mib:.2f} MiB")
        return lines

    # ---- the run ----
    def run(self) -> int:
        a = self.a
        if a.steps < 0 or a.batch_size < 1 or a.eval_batches < 1:
            raise UserError("--steps must be >= 0, --batch-size and --eval-batches positive")
        if a.resume and not a.checkpoint:
            raise UserError("--resume needs --checkpoint DIR")
        if a.threads:
            from ibp_embed import _native

            torch.set_num_threads(a.threads)
            _native.set_num_threads(a.threads)
        self.lr = a.lr if a.lr is not None else DEFAULT_LR[a.optimizer]
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be positive and finite, not {self.lr}")
        kind, paths = a.data[0], a.data[1:]
        if kind not in ("generated", "criteo-tsv", "criteo-npy"):
            raise UserError(f"--data: unknown kind {kind!r} (generated, criteo-tsv FILE, criteo-npy DIR)")
        if kind == "generated" and paths:
            raise UserError("--data generated takes no path")
        if kind == "criteo-npy" and len(paths) != 1:
            raise UserError("--data criteo-npy takes one directory")
        if kind == "criteo-tsv" and not paths:
            raise UserError("--data criteo-tsv needs at least one file")
        try:
            cfg = model_config(a)
        except ValueError as e:
            raise UserError(str(e)) from None
        data = make_source(kind, paths if kind == "criteo-tsv" else (paths[0] if paths else None),
                           scale=a.scale, seed=a.seed, alpha=a.zipf, multi_hot=a.multi_hot,
                           eval_samples=a.eval_batches * a.batch_size, max_samples=a.max_samples,
                           max_bad_lines=a.max_bad_lines, max_bad_fraction=a.max_bad_fraction)
        self.init_dist()
        self.log(f"data: {data.description}")
        if data.report():
            self.log(f"data: {data.report()}")

        path = None
        if a.checkpoint and (a.resume or a.eval_only):
            path = ckpt.latest(Path(a.checkpoint))
            if path is None:
                if a.eval_only:
                    raise UserError(f"{a.checkpoint}: no checkpoint to evaluate")
                self.log(f"resume: no checkpoint in {a.checkpoint} yet, starting from step 0")
            else:
                meta = ckpt.read_meta(path)
                ckpt.check_compatible(meta, path, backend=a.backend, model_config=cfg.to_dict(),
                                      optimizer=a.optimizer, eval_only=a.eval_only)
                changed = [k for k, v in (("seed", a.seed), ("batch_size", a.batch_size), ("data", a.data),
                                          ("lr", self.lr), ("world_size", self.world)) if meta.get(k) != v]
                if changed and not a.eval_only:
                    self.log(f"note: {', '.join(changed)} differ from the checkpoint's; the run continues, "
                             f"but not as the original run would have")
        train = not a.eval_only
        built = self.build(cfg, load_tables=path is None)
        dense_opt = dense_optimizer(a.optimizer, self.lr, [p for _, p in dense_named_parameters(built.model)]) \
            if train else None
        start = 0
        last_loss = float("nan")
        if path is not None:
            blob = self.restore(built, dense_opt, path, train)
            start = int(blob.get("step", 0))
            last_loss = float(blob.get("last_loss", float("nan")))
            self.log(f"resumed from {path} (step {start})")
        self.log(f"model: {cfg.model}, {len(cfg.cardinalities)} tables, {sum(cfg.cardinalities):,} rows x "
                 f"{cfg.embedding_dim}; backend {a.backend}, optimizer {a.optimizer} lr {self.lr}, "
                 f"batch {a.batch_size} on {self.world} rank(s)")

        steps_done = 0
        elapsed = 0.0
        if train and start < a.steps:
            last_loss, steps_done, elapsed = self.train_loop(built, dense_opt, data, cfg, start)
        if train and a.checkpoint and (steps_done or path is None):
            saved = self.save(built, dense_opt, cfg, max(start + steps_done, start), last_loss)
            self.log(f"checkpoint: {saved}")
        if steps_done:
            self.log(f"trained {steps_done} steps in {elapsed:.1f} s: "
                     f"{steps_done * a.batch_size / max(elapsed, 1e-9):,.0f} samples/s")
        auc, logloss = self.evaluate(built, data)
        self.built, self.data = built, data
        self.result = {"train_loss": last_loss if train else None, "eval_auc": auc, "eval_logloss": logloss,
                       "steps": start + steps_done, "train_seconds": elapsed, "steps_done": steps_done}
        memory = self.rank_memory(built)
        for line in self.memory_lines(built.backend, memory):
            self.log(line)
        if a.report and self.rank == 0:
            import json

            report = dict(self.result, backend=a.backend, world_size=self.world, batch_size=a.batch_size,
                          samples_per_s=steps_done * a.batch_size / max(elapsed, 1e-9) if steps_done else None,
                          ibp_tables=list(built.ibp_tables), memory_per_rank=memory)
            Path(a.report).write_text(json.dumps(report, indent=1))
        if data.report():
            self.log(f"data: {data.report()}")
        loss_text = f"{last_loss:.8f}" if train else "n/a"
        self.log(f"final: backend={a.backend} model={a.model} steps={start + steps_done if train else start} "
                 f"train_loss={loss_text} eval_auc={auc:.6f} eval_logloss={logloss:.6f}")
        return 0

    def train_loop(self, built: Built, dense_opt, data: DataSource, cfg: ModelConfig, start: int):
        from tqdm.auto import tqdm

        a = self.a
        lo, hi = rank_slice(a.batch_size, self.rank, self.world)
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(signum, frame):
            self.stop_signal = signum
            for s, h in old.items():  # a second signal acts at once
                signal.signal(s, h)

        for s in old:
            signal.signal(s, on_signal)
        bar = tqdm(total=a.steps, initial=start, disable=a.no_progress or self.rank != 0, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
        last_loss = float("nan")
        done = 0
        t0 = time.perf_counter()
        try:
            for step in range(start, a.steps):
                batch = data.train_batch(step, a.batch_size).rows(lo, hi)
                logits = built.module(batch.dense, batch.kjt()).squeeze(-1)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
                value = loss.detach().double()
                if self.world > 1:
                    import torch.distributed as dist

                    dist.all_reduce(value)
                    value /= self.world
                value = float(value)
                if not math.isfinite(value):
                    raise NaNLoss(f"training loss is {value} at step {step} (learning rate {self.lr} too "
                                  f"high?); no update was applied at that step"
                                  + (f"; the last checkpoint is in {a.checkpoint}" if a.checkpoint else ""))
                dense_opt.zero_grad(set_to_none=True)
                loss.backward()
                dense_opt.step()
                last_loss = value
                done += 1
                elapsed = time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{done * a.batch_size / max(elapsed, 1e-9):,.0f}",
                                refresh=False)
                at = step + 1
                stop = self.allreduce_max(1.0 if self.stop_signal is not None else 0.0) > 0
                if a.checkpoint and a.checkpoint_every and at % a.checkpoint_every == 0 and at < a.steps \
                        and not stop:
                    self.save(built, dense_opt, cfg, at, last_loss)
                if stop:
                    bar.close()
                    msg = f"interrupted after step {at}"
                    if a.checkpoint:
                        saved = self.save(built, dense_opt, cfg, at, last_loss)
                        msg += f"; checkpoint written to {saved}; rerun with --resume to continue"
                    raise KeyboardInterrupt(msg)
        finally:
            bar.close()
            for s, h in old.items():
                signal.signal(s, h)
        return last_loss, done, time.perf_counter() - t0


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    quiet_library_warnings()
    run = Run(a)
    try:
        code = run.run()
    except (UserError, DataError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_BAD_INPUT
    except NaNLoss as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_NAN
    except KeyboardInterrupt as e:
        print(f"{e or 'interrupted'}", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    finally:
        run.close()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, freeing the model can deadlock: DDP's reducer is freed
        # holding the GIL, the gloo process group's destructor joins its worker
        # threads, and one of them waits for the GIL to free a finished collective
        # (seen as a rank hanging forever after its final line). Everything is
        # written and flushed by now, so leave before `run` and the model are freed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
