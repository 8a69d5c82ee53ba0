"""Train / evaluate DLRM (or DLRM_DCN) on IBP-compressed or TorchRec tables.

    python -m dlrm_example.train --backend ibp|torchrec [--steps N] [--seed S]
        [--data generated | --data criteo-tsv FILE... | --data criteo-npy DIR]
        [--scale F] [--zipf A] [--multi-hot] [--model dlrm|dcn] [--batch-size B]
        [--lr LR] [--optimizer sgd|adagrad] [--checkpoint DIR [--resume] [--checkpoint-every N]]
        [--eval-only] ...
    torchrun --nproc_per_node 2 -m dlrm_example.train ...       # gloo, CPU

The same --seed gives the same data and the same initial weights for both backends;
with the same options the two backends compute the same losses (bit for bit on one
process, see tests/test_dlrm_example.py). The last line printed is

    final: backend=ibp model=dlrm steps=200 train_loss=0.48210000 eval_auc=0.7512 eval_logloss=0.4790

Exit status: 0 done; 2 bad input (data files, checkpoint, options); 3 the loss became
NaN or infinite; 130 interrupted (a checkpoint is written first when --checkpoint is
given; rerun with --resume to continue from it).

Multi-process (torchrun, gloo on CPU): --batch-size is the global batch, each rank
trains on its slice. torchrec: DistributedModelParallel, every table table-wise on
FBGEMM's fused kernel, dense part data-parallel. ibp: every rank holds all compressed
tables; backward all-gathers ids and output gradients so every replica applies the
same update (the one a table-wise sharded table gets); dense part in DDP.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint as ckpt
from .data import DataError, DataSource, make_source, rank_slice
from .model import (
    BACKENDS, MODELS, OPTIMIZERS, Built, ModelConfig, build_ibp, build_torchrec, dense_named_parameters,
    dense_optimizer, dense_state, load_dense_state, local_state_shards, local_table_shards, sparse_optimizer,
)

EXIT_BAD_INPUT = 2
EXIT_NAN = 3
EXIT_INTERRUPTED = 130
DEFAULT_LR = {"sgd": 0.1, "adagrad": 0.05}


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
        elif self.a.backend == "torchrec" and not dist.is_initialized():
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
    def build(self, cfg: ModelConfig, train: bool, load_tables: bool) -> Built:
        a = self.a
        if a.backend == "ibp":
            opt = sparse_optimizer(a.optimizer, self.lr) if train else None
            return build_ibp(cfg, a.seed, opt, world=self.world, load_tables=load_tables)
        return build_torchrec(cfg, a.seed, a.optimizer, self.lr, world=self.world, load_tables=load_tables)

    # ---- checkpoints ----
    def meta(self, cfg: ModelConfig) -> dict:
        a = self.a
        return {"backend": a.backend, "model_config": cfg.to_dict(), "optimizer": a.optimizer, "lr": self.lr,
                "world_size": self.world, "seed": a.seed, "batch_size": a.batch_size, "data": a.data}

    def save(self, built: Built, dense_opt, cfg: ModelConfig, step: int, last_loss: float) -> Path:
        import torch.distributed as dist
        from ibp_embed import compress

        root = Path(self.a.checkpoint)
        tmp = [ckpt.begin(root, step) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(tmp, src=0)
        tmp = Path(tmp[0])
        if built.backend == "ibp":
            if self.rank == 0:
                built.ebc.save_compressed(tmp / "tables")
        else:
            index = {}
            for name, shard in local_table_shards(built):
                if tuple(shard.metadata.shard_offsets) != (0, 0):
                    raise NotImplementedError("checkpoints of non table-wise torchrec shards")
                fname = f"{name}.ibp"
                compress(shard.tensor.detach()).save(tmp / "tables" / fname)
                index[name] = {"file": fname, "state": {}}
            for name, key, shard in local_state_shards(built):
                sname = f"{name}.{key}.npy"
                ckpt.save_npy(tmp / "tables" / sname, shard.tensor.detach().reshape(-1).numpy())
                index[name]["state"][key] = sname
            ckpt.write_json(tmp / "tables" / f"tables-rank{self.rank}.json", index)
        if self.rank == 0:
            ckpt.save_dense(tmp, dense_state(built.model), dense_opt.state_dict() if dense_opt else {},
                            {"step": step, "last_loss": last_loss})
        self.barrier()
        final = None
        if self.rank == 0:
            final = ckpt.commit(root, tmp, step, self.meta(cfg))
        self.barrier()
        return final if final is not None else root / ckpt.step_name(step)

    def restore(self, built: Built, dense_opt, path: Path, train: bool):
        """Load tables (+ optimizer state), dense weights (+ dense optimizer state)."""
        import ibp_embed

        if built.backend == "ibp":
            from ibp_embed.torchrec import IBPEmbeddingBagCollection

            opt = sparse_optimizer(self.a.optimizer, self.lr) if train else None
            try:
                ebc = IBPEmbeddingBagCollection.load_compressed(
                    path / "tables", optimizer=opt, mmap=not train)
            except (OSError, ValueError) as e:
                raise ckpt.CheckpointError(f"{path}/tables: {e}") from None
            old = built.ebc
            if [c.name for c in ebc.embedding_bag_configs()] != [c.name for c in old.embedding_bag_configs()] or \
                    [c.num_embeddings for c in ebc.embedding_bag_configs()] != \
                    [c.num_embeddings for c in old.embedding_bag_configs()]:
                raise ckpt.CheckpointError(f"{path}: its tables do not match this model")
            built.model.sparse_arch.embedding_bag_collection = ebc
        else:
            index_path = path / "tables" / f"tables-rank{self.rank}.json"
            try:
                import json

                index = json.loads(index_path.read_text())
            except (OSError, ValueError) as e:
                raise ckpt.CheckpointError(f"{index_path}: unreadable: {e}") from None
            with torch.no_grad():
                for name, shard in local_table_shards(built):
                    if name not in index:
                        raise ckpt.CheckpointError(f"{index_path}: no table {name!r}")
                    try:
                        w = ibp_embed.load(path / "tables" / index[name]["file"]).decompress()
                    except (OSError, ValueError) as e:
                        raise ckpt.CheckpointError(f"{path}/tables/{index[name]['file']}: {e}") from None
                    if w.shape != shard.tensor.shape:
                        raise ckpt.CheckpointError(f"{path}: table {name} has shape {tuple(w.shape)}, the model "
                                                   f"{tuple(shard.tensor.shape)}")
                    shard.tensor.copy_(w)
                if train:
                    for name, key, shard in local_state_shards(built):
                        f = index.get(name, {}).get("state", {}).get(key)
                        if f is None:
                            raise ckpt.CheckpointError(f"{index_path}: no {key} for table {name!r}")
                        v = torch.from_numpy(ckpt.load_npy(path / "tables" / f))
                        if v.numel() != shard.tensor.numel():
                            raise ckpt.CheckpointError(f"{path}: {key} of {name} has {v.numel()} values, "
                                                       f"expected {shard.tensor.numel()}")
                        shard.tensor.copy_(v.reshape(shard.tensor.shape))
        blob = ckpt.load_dense(path)
        try:
            load_dense_state(built.model, blob["dense"])
            if train and dense_opt is not None:
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
    def memory_line(self, built: Built) -> str:
        if built.backend == "ibp":
            s = built.ebc.memory_stats()
            return (f"table memory: raw {s['raw_bytes'] / 2**20:.2f} MiB, compressed "
                    f"{s['compressed_bytes'] / 2**20:.2f} MiB now (packed {s['packed_bytes'] / 2**20:.2f} MiB, "
                    f"ratio {s['raw_bytes'] / max(s['packed_bytes'], 1):.3f}), optimizer state "
                    f"{s['optimizer_state_bytes'] / 2**20:.2f} MiB")
        raw = sum(sh.tensor.numel() * sh.tensor.element_size() for _, sh in local_table_shards(built))
        try:
            st = sum(sh.tensor.numel() * sh.tensor.element_size() for *_, sh in local_state_shards(built))
        except Exception:  # noqa: BLE001 - eval-only torchrec models may lack a fused optimizer
            st = 0
        return f"table memory (rank {self.rank}): raw {raw / 2**20:.2f} MiB, optimizer state {st / 2**20:.2f} MiB"

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
                                      optimizer=a.optimizer, world_size=self.world, eval_only=a.eval_only)
                changed = [k for k, v in (("seed", a.seed), ("batch_size", a.batch_size), ("data", a.data),
                                          ("lr", self.lr), ("world_size", self.world)) if meta.get(k) != v]
                if changed and not a.eval_only:
                    self.log(f"note: {', '.join(changed)} differ from the checkpoint's; the run continues, "
                             f"but not as the original run would have")
        train = not a.eval_only
        built = self.build(cfg, train=train, load_tables=path is None)
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
        self.log(self.memory_line(built))
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
