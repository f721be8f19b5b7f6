"""The tiny world DeepSpeed-Chat's steps run on in tests: no download, nothing random across runs.

    python tests/data/deepspeed_chat/fixture.py OUT_DIR     # writes OUT_DIR/model, OUT_DIR/critic and OUT_DIR/Dahoas/rm-static

* ``model/``: an OPT of 4 layers, width 32, built from a config with seed 0, saved with a
  byte-level BPE tokenizer trained on the texts below (``</s>`` is OPT's bos/eos/pad);
* ``critic/``: what DeepSpeed-Chat's step 3 loads as its critic and reward model (step 2's
  output): the model's config and tokenizer, and a ``pytorch_model.bin`` holding a RewardModel's
  weights, the OPT body of ``model/`` (``rwtransformer.*``) and a value head drawn with seed 1;
* ``Dahoas/rm-static/{train,test}.json``: prompt/chosen/rejected triples in that dataset's
  shape ("Human: add 3 and 4 Assistant:" / " 7" / " 9"); the directory name makes DeepSpeed-Chat
  pick its rm-static reader, and the ``datasets`` stand-in in shims/ reads the files.
"""

import json
import random
import sys
from pathlib import Path

def corpus(samples: list[dict]) -> list[str]:
    return [s["prompt"] + s["chosen"] for s in samples] + [s["prompt"] + s["rejected"] for s in samples]


def write_tokenizer(out: Path, texts: list[str]) -> None:
    """OPT's tokenizer kind (GPT-2 byte-level BPE: vocab.json + merges.txt, which DeepSpeed-Chat's
    save_vocabulary copies), trained on the synthetic texts; </s> is bos, eos and pad."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=280, min_frequency=1, special_tokens=["</s>", "<unk>"])
    out.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(out))
    # Written by hand: transformers 5.24's save_pretrained of this tokenizer writes a tokenizer.json
    # that reloads without the vocabulary; from vocab.json + merges.txt it loads whole.
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "</s>", "add_prefix_space": False, "model_max_length": 64}))


def write_model(out: Path) -> None:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=280, hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(out)


def write_critic(model: Path, out: Path) -> None:
    import shutil

    import torch
    from transformers import OPTModel

    shutil.copytree(model, out)
    body = OPTModel.from_pretrained(model)
    state = {f"rwtransformer.{key}": value for key, value in body.state_dict().items()}
    torch.manual_seed(1)
    state["v_head.weight"] = torch.randn(1, body.config.word_embed_proj_dim) * 0.5
    torch.save(state, out / "pytorch_model.bin")


def samples(count: int, generator: random.Random) -> list[dict]:
    def one():
        a, b = generator.randrange(10), generator.randrange(10)
        wrong = (a + b + 1 + generator.randrange(3)) % 20
        return {"prompt": f" Human: add {a} and {b} Assistant:", "chosen": f" {a + b}", "rejected": f" {wrong}"}

    return [one() for _ in range(count)]


def build(root: Path, train: int = 64, test: int = 16) -> tuple[Path, Path]:
    generator = random.Random(0)
    splits = {"train": samples(train, generator), "test": samples(test, generator)}
    data = root / "Dahoas" / "rm-static"
    data.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (data / f"{split}.json").write_text(json.dumps(rows))
    model = root / "model"
    write_model(model)
    write_tokenizer(model, corpus(splits["train"] + splits["test"]))
    write_critic(model, root / "critic")
    return model, data


if __name__ == "__main__":
    print(*build(Path(sys.argv[1])))
