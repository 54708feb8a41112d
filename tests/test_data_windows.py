"""Windows, the sink collator, and the seeded, sharded, resumable order (Lightning included)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from sinklm.data import (
    IGNORE_INDEX,
    DataError,
    PackedDataset,
    PrepareConfig,
    ResumableLoader,
    ResumableSampler,
    SinkCollator,
    SourceSpec,
    build_loader,
    prepare_data,
    train_tokenizer,
)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture(scope="module")
def data_packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small packed corpus (a byte-level BPE trained on it; about 9k tokens)."""
    root = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 200)))) + f" {i}."
             for i in range(120)]
    source = root / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_tokenizer(texts, 300)
    for name, shard_tokens in (("one", 1 << 30), ("sharded", 97)):
        config = PrepareConfig(
            source=SourceSpec(str(source), cache_dir=str(root / "cache")),
            output=str(root / name), val_fraction=0.1, shard_tokens=shard_tokens,
        )
        prepare_data(config, tokenizer, log=None)
    return root


def stream(directory: Path, split: str = "train") -> np.ndarray:
    meta = json.loads((directory / "meta.json").read_text())
    return np.concatenate([np.fromfile(directory / s["file"], dtype=meta["dtype"])
                           for s in meta["splits"][split]["shards"]])


def test_windows_are_consecutive_slices_sharing_one_token(data_packed: Path) -> None:
    tokens = stream(data_packed / "one")
    for seq_len, sinks in ((64, 0), (64, 1), (33, 3)):
        text = seq_len - sinks
        for name in ("one", "sharded"):
            ds = PackedDataset(data_packed / name, "train", seq_len, sinks)
            assert len(ds) == (tokens.size - 1) // text
            for i in range(len(ds)):
                assert np.array_equal(ds[i], tokens[i * text : i * text + text + 1])
    validation = PackedDataset(data_packed / "one", "validation", 16)
    assert np.array_equal(validation[0], stream(data_packed / "one", "validation")[:17])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_collator_puts_sinks_first_and_never_targets_them(data_packed: Path) -> None:
    ds = PackedDataset(data_packed / "one", "train", seq_len=16, sink_tokens=2)
    windows = [ds[i] for i in range(4)]
    batch = SinkCollator([300, 301], 16)(windows)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (4, 16)
    assert ids.dtype == labels.dtype == torch.long
    w = torch.tensor(np.stack(windows).astype(np.int64))  # [4, 15]: 14 text tokens + 1
    assert torch.equal(ids[:, :2], torch.tensor([[300, 301]] * 4))
    assert torch.equal(ids[:, 2:], w[:, :-1])
    assert torch.all(labels[:, 0] == IGNORE_INDEX)  # its target would be the second sink
    assert torch.equal(labels[:, 1], w[:, 0])  # the last sink predicts the first text token
    assert torch.equal(labels[:, 1:-1], ids[:, 2:])  # labels[t] is the token at t + 1
    assert torch.equal(labels[:, -1], w[:, -1])
    assert not torch.isin(labels, torch.tensor([300, 301])).any()


def test_one_sink_every_position_has_a_target_and_no_sinks_is_plain_lm(
    data_packed: Path,
) -> None:
    windows = [PackedDataset(data_packed / "one", "train", 16, 1)[i] for i in range(3)]
    labels = SinkCollator([300], 16)(windows)["labels"]
    assert (labels != IGNORE_INDEX).all()
    plain = [PackedDataset(data_packed / "one", "train", 16, 0)[i] for i in range(3)]
    batch = SinkCollator([], 16)(plain)
    w = torch.tensor(np.stack(plain).astype(np.int64))
    assert torch.equal(batch["input_ids"], w[:, :-1]) and torch.equal(batch["labels"], w[:, 1:])
    # The loss recipe for the trainer works on the batch as is.
    logits = torch.zeros(3, 16, 310)
    loss = nn.functional.cross_entropy(logits.view(-1, 310), batch["labels"].view(-1))
    assert torch.isclose(loss, torch.log(torch.tensor(310.0)))


def test_a_sink_id_inside_the_text_is_not_a_target() -> None:
    window = np.array([5, 6, 300, 7, 8])
    labels = SinkCollator([300], 5)([window])["labels"][0].tolist()
    assert labels == [5, 6, IGNORE_INDEX, 7, 8]


def test_bad_lengths_and_mismatches_are_clear(data_packed: Path) -> None:
    with pytest.raises(DataError, match="seq_len=2 leaves no room for text after 2 sink"):
        PackedDataset(data_packed / "one", "train", seq_len=2, sink_tokens=2)
    with pytest.raises(DataError, match="seq_len=1 leaves no room"):
        SinkCollator([300, 301], 1)
    ds = PackedDataset(data_packed / "one", "train", 16, 1)
    with pytest.raises(DataError, match="2 sink id"):
        build_loader(ds, 4, [300, 301])
    with pytest.raises(DataError, match="windows of 15 tokens, but seq_len=16 with 1 sink"):
        SinkCollator([300], 16)([np.arange(15)])
    with pytest.raises(DataError, match="packed with another tokenizer"):
        PackedDataset(data_packed / "one", "train", 16, tokenizer_hash="0" * 64)
    with pytest.raises(DataError, match="fewer than one window"):
        PackedDataset(data_packed / "one", "validation", 100000)
    with pytest.raises(DataError, match="no split 'test'"):
        PackedDataset(data_packed / "one", "test", 16)
    with pytest.raises(DataError, match=r"no meta\.json"):
        PackedDataset(data_packed, "train", 16)


def test_order_is_a_seeded_permutation_per_epoch() -> None:
    def epoch(seed: int, number: int, shuffle: bool = True) -> list[int]:
        sampler = ResumableSampler(50, seed=seed, rank=0, world_size=1, shuffle=shuffle)
        sampler.set_epoch(number)
        return list(sampler)

    assert epoch(1, 0) == epoch(1, 0)
    assert sorted(epoch(1, 0)) == list(range(50))
    assert epoch(1, 0) != epoch(2, 0)
    assert epoch(1, 0) != epoch(1, 1)
    assert epoch(1, 3, shuffle=False) == list(range(50))


@pytest.mark.parametrize("size", [50, 51])
def test_ranks_are_disjoint_and_cover_the_epoch(size: int) -> None:
    parts = [list(ResumableSampler(size, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == size // 2
    assert not set(parts[0]) & set(parts[1])
    whole = ResumableSampler(size, seed=3, rank=0, world_size=1).order(0)
    assert set(parts[0]) | set(parts[1]) == set(whole[: size - size % 2].tolist())


def run(loaders: list[ResumableLoader], batches: int | None = None) -> list[list[Tensor]]:
    """Per rank, the input_ids of the next ``batches`` steps (all ranks step together)."""
    seen: list[list[Tensor]] = [[] for _ in loaders]
    iterators = [iter(loader) for loader in loaders]
    while batches is None or len(seen[0]) < batches:
        try:
            steps = [next(it) for it in iterators]
        except StopIteration:
            break
        for rank, batch in enumerate(steps):
            seen[rank].append(batch["input_ids"])
    return seen


def two_epochs(loaders: list[ResumableLoader]) -> list[list[Tensor]]:
    first, second = run(loaders), run(loaders)
    return [a + b for a, b in zip(first, second, strict=True)]


def loaders(directory: Path, world_size: int, num_workers: int = 0) -> list[ResumableLoader]:
    ds = PackedDataset(directory, "train", 32, sink_tokens=1)
    return [build_loader(ds, 4, [300], seed=11, rank=r, world_size=world_size,
                         num_workers=num_workers) for r in range(world_size)]


def same(a: list[list[Tensor]], b: list[list[Tensor]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stop", ["mid", "end"])
def test_resume_gives_the_batches_an_uninterrupted_loader_gives(
    data_packed: Path, world_size: int, stop: str
) -> None:
    reference = two_epochs(loaders(data_packed / "one", world_size))
    per_epoch = len(loaders(data_packed / "one", world_size)[0])
    assert len(reference[0]) == 2 * per_epoch
    if world_size == 2:
        windows = [set() for _ in range(2)]
        for rank in range(2):
            for batch in reference[rank][:per_epoch]:
                windows[rank] |= {tuple(row.tolist()) for row in batch}
        assert not windows[0] & windows[1]
    k = per_epoch // 2 if stop == "mid" else per_epoch
    interrupted = loaders(data_packed / "one", world_size)
    before = run(interrupted, k)
    state = interrupted[0].state_dict()  # rank 0's state is what a checkpoint holds
    resumed = loaders(data_packed / "one", world_size)
    for loader in resumed:
        loader.load_state_dict(state)
    after = two_epochs(resumed) if stop == "mid" else run(resumed)
    combined = [b + a for b, a in zip(before, after, strict=True)]
    assert same(combined, reference)


def test_resume_with_worker_processes_counts_yielded_batches(data_packed: Path) -> None:
    reference = run(loaders(data_packed / "one", 1))
    interrupted = loaders(data_packed / "one", 1, num_workers=2)
    before = run(interrupted, 3)  # workers have prefetched more than 3 batches by now
    state = interrupted[0].state_dict()
    assert state["sampler"]["consumed"] == 3 * 4
    resumed = loaders(data_packed / "one", 1, num_workers=2)
    resumed[0].load_state_dict(state)
    assert same([before[0] + run(resumed)[0]], reference)


def test_resume_on_another_world_size_continues_the_same_order(data_packed: Path) -> None:
    two = loaders(data_packed / "one", 2)
    run(two, 3)
    state = two[0].state_dict()
    one = loaders(data_packed / "one", 1)
    one[0].load_state_dict(state)
    rest = torch.cat(run(one)[0])
    order = one[0].sampler.order(0)
    ds = PackedDataset(data_packed / "one", "train", 32, 1)
    expected = order[2 * 3 * 4 :][: len(rest)]
    windows = np.stack([ds[i][:-1] for i in expected]).astype(np.int64)
    assert torch.equal(rest[:, 1:], torch.from_numpy(windows))
    bad = ResumableSampler(len(ds), seed=11, rank=0, world_size=5)
    with pytest.raises(DataError, match="5 ranks cannot split evenly"):
        bad.load_state_dict(state["sampler"])
    with pytest.raises(DataError, match="num_samples="):
        ResumableSampler(len(ds) + 1, seed=11).load_state_dict(state["sampler"])


class Recorder(L.LightningModule):
    """Records the batches training sees; one parameter so the optimizer has work."""

    def __init__(self, loader_factory: object) -> None:
        super().__init__()
        self.loader_factory = loader_factory
        self.weight = nn.Parameter(torch.zeros(1))
        self.seen: list[Tensor] = []

    def train_dataloader(self) -> ResumableLoader:
        return self.loader_factory()

    def training_step(self, batch: dict[str, Tensor], index: int) -> Tensor:
        self.seen.append(batch["input_ids"].clone())
        return (self.weight * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(tmp_path: Path, factory: object, ckpt_path: str | None = None, **limits: int) -> Recorder:
    module = Recorder(factory)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1,
                                   save_top_k=-1, filename="{step}")],
        **limits,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
@pytest.mark.parametrize("stop_fraction", [0.5, 1.0])
def test_lightning_fit_resumes_mid_epoch_with_the_same_batches(
    data_packed: Path, tmp_path: Path, stop_fraction: float
) -> None:
    ds = PackedDataset(data_packed / "one", "train", 64, sink_tokens=1)

    def factory() -> ResumableLoader:
        return build_loader(ds, 8, [300], seed=5, rank=0, world_size=1)

    per_epoch = len(factory())
    reference = fit(tmp_path / "a", factory, max_epochs=2).seen
    assert len(reference) == 2 * per_epoch
    stop = int(per_epoch * stop_fraction)
    first = fit(tmp_path / "b", factory, max_steps=stop).seen
    ckpt = tmp_path / "b" / "ckpt" / f"step={stop}.ckpt"
    second = fit(tmp_path / "c", factory, ckpt_path=str(ckpt), max_epochs=2).seen
    assert same([first + second], [reference])
