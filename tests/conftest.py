import os
from pathlib import Path

import pytest
import torch

# Bitwise reproducibility depends on the thread count (docs/design.md §8): pin it. One thread: the tiny
# test models gain nothing from two, and two threads per process oversubscribe a 2-core machine.
torch.set_num_threads(int(os.environ.get("DGEMMA_TEST_THREADS", "1")))

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------- tiny models the serving and lm-eval tests share
def train_tiny_sudoku(workdir: Path, *extra: str) -> Path:
    """A 1-layer Sudoku run of 10 steps at a high rate: far from solving, but a real workdir that
    load_run opens, and trained enough to fill the canvas with digits rather than stop tokens."""
    from dgemma.training.config import parse_cli
    from dgemma.training.trainer import train

    threads = torch.get_num_threads()
    cfg, _ = parse_cli([f"--cfg={REPO / 'configs' / 'sudoku_small.py'}", f"--cfg.workdir={workdir}",
                        "--cfg.train.steps=10", "--cfg.train.checkpoint_every=10", "--cfg.model.num_hidden_layers=1",
                        '--cfg.model.layer_types=["full_attention"]', "--cfg.data.batch_size=8",
                        "--cfg.optim.warmup_steps=0", "--cfg.optim.lr=1e-2", "--cfg.data.pin_clues=true", *extra])
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)
    return workdir


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    return train_tiny_sudoku(tmp_path_factory.mktemp("serve") / "tiny_sudoku")


@pytest.fixture(scope="session")
def tiny_run_sc(tmp_path_factory) -> Path:
    """The tiny Sudoku run with a self-conditioning block (the shipped Sudoku model has none)."""
    return train_tiny_sudoku(tmp_path_factory.mktemp("serve") / "tiny_sudoku_sc", "--cfg.model.self_conditioning=true")


def tiny_bpe(texts: list[str]):
    """A byte-level BPE (300 tokens) with Gemma's special tokens, trained on ``texts`` x 5, as
    dgemma's Tokenizer: any text round-trips and the chat template applies."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    from dgemma.data.tokenizers import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(list(texts) * 5, trainer)
    return Tokenizer(backend)


def write_tiny_text_model(folder: Path) -> Path:
    """An untrained 2-layer Gemma 3 (width 32, 128 positions) with a byte-level BPE tokenizer that
    has Gemma's special tokens, saved as a Hugging Face folder: any text round-trips and the chat
    template applies, so a server or the harness treats it as a small pretrained model. Its
    samples are noise over the 320-token vocabulary, EOS now and then."""
    from dgemma.models.transformer import DiffusionGemma, ModelConfig
    from dgemma.models.weights import save_hf

    tokenizer = tiny_bpe(["The capital of France is Paris.", "12345 67890 3.14159", "hello world"])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=128,
                      layer_types=["sliding_attention", "full_attention"])
    return save_hf(DiffusionGemma(cfg).eval(), tokenizer, folder)


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory) -> Path:
    return write_tiny_text_model(tmp_path_factory.mktemp("text") / "tiny_text")
