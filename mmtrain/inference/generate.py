"""`mmtrain generate`: text from a trained model, with a KV cache (models/inference).

    mmtrain generate --ckpt RUN_OR_CKPT_OR_EXPORT
                     (--image F | --video F | --shard S --key K [K ...] | --jsonl F) [--prompt TEXT]
                     [--max-new-tokens N] [--temperature T --top-p P --seed S] [--out F.jsonl]

Library (notebooks, evals):

    from mmtrain.inference.generate import generate, load
    from mmtrain.inference.prompts import medium_file
    m = load("runs/tiny")                                    # run, checkpoint or export directory
    res = generate(m, [medium_file("cat.png", "image", m.cfg.data.media)])
    print(res.generations[0].text)

Without a prompt text the model continues right after the medium, where the corpus's captions
start: it captions it. Decoding stops at the end-of-document token, after max_new_tokens, or at
the context the model was trained for (data.seq_len). Special tokens other than end-of-document
(bos, media markers and placeholders) are never generated. Prompts are decoded in batches; each
prompt's output does not depend on its batch (sampling draws from a generator per prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from mmtrain.data_pipelines.packing import assemble
from mmtrain.errors import UserError
from mmtrain.inference.loading import Loaded, checkpoint_line, load_model
from mmtrain.inference.prompts import (
    Prompt,
    jsonl_prompts,
    medium_file,
    prompt_document,
    read_samples,
    sample_prompt,
)
from mmtrain.models.inference import SamplingConfig, generate_tokens


@dataclass
class Generation:
    name: str
    prompt: str  # the prompt text after the media
    text: str  # what the model generated (without the end-of-document token)
    finish: str  # "eos" or "length"
    prompt_tokens: int
    new_tokens: int
    reference: str | None = None  # the sample's own caption, when the prompt came from a sample


@dataclass
class GenerateResult:
    generations: list[Generation] = field(default_factory=list)
    seconds: float = 0.0
    cache_bytes_per_token: float = 0.0  # KV cache (+ sparse block means) per position, all layers

    @property
    def new_tokens(self) -> int:
        return sum(g.new_tokens for g in self.generations)


def load(path: str, device: str = "auto") -> Loaded:
    """A checkpoint directory, a run directory (its newest verified checkpoint) or an export."""
    return load_model(path, device)


@torch.no_grad()
def generate(m: Loaded, prompts: list[Prompt], sampling: SamplingConfig | None = None, batch_size: int = 8,
             blank_media: bool = False) -> GenerateResult:
    """Decode every prompt (batches of `batch_size`); `blank_media` zeroes the pixels (flat grey), as
    the reliance gap does."""
    sampling = sampling or SamplingConfig()
    tok, data = m.tokenizer, m.cfg.data
    docs = [prompt_document(p, tok, data) for p in prompts]
    special = tok.special
    banned = [i for i in special.as_tuple() if i != special.eos]
    res, t0 = GenerateResult(), time.perf_counter()
    for i in range(0, len(docs), batch_size):
        chunk = docs[i:i + batch_size]
        S = max(len(d) for d in chunk)
        batch = assemble([[d] for d in chunk], S, special.pad, m.cfg.model.vision.patch_dim)
        if blank_media:
            batch = replace(batch, patches_NP=torch.zeros_like(batch.patches_NP))
        out = generate_tokens(m.model, batch.to(m.device).model_inputs(), sampling, special.eos, banned,
                              max_len=data.seq_len)
        res.cache_bytes_per_token = out.cache_bytes_per_token
        for p, ids, fin, n in zip(prompts[i:i + batch_size], out.tokens, out.finish, out.prompt_len):
            text = tok.decode(ids[:-1] if fin == "eos" else ids)
            res.generations.append(Generation(p.name, p.text, text, fin, n, len(ids), p.reference))
    res.seconds = time.perf_counter() - t0
    return res


# ----- command line -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="RUN/step_<N>, a run directory (its newest checkpoint) "
                                                      "or an `mmtrain export` directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--image", help="an image file to caption (or to prompt about)")
    src.add_argument("--video", help="a video file")
    src.add_argument("--shard", help="a webdataset shard; with --key, one of its samples (media kept, "
                                     "caption dropped and reported as the reference)")
    src.add_argument("--jsonl", help="prompts, one JSON object a line: {\"image\"|\"video\": PATH, "
                                     "\"prompt\": ...}, {\"segments\": [...]} or {\"text\": ...}")
    parser.add_argument("--key", nargs="+", help="the key(s) of --shard's samples (a brace range or glob may "
                                                 "name several shards)")
    parser.add_argument("--prompt", default="", help="text after the media (default none: a caption)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", help="write one JSON line per prompt here")


def _prompts(args: argparse.Namespace, m: Loaded) -> list[Prompt]:
    media = m.cfg.data.media
    if args.image or args.video:
        kind = "image" if args.image else "video"
        return [medium_file(args.image or args.video, kind, media, args.prompt)]
    if args.shard:
        if not args.key:
            raise UserError("--shard: give the sample with --key")
        return [sample_prompt(raw, media, args.prompt) for raw in read_samples(args.shard, args.key)]
    return jsonl_prompts(args.jsonl, media, args.prompt)


def run(args: argparse.Namespace) -> int:
    if args.key and not args.shard:
        raise UserError("--key: only with --shard")
    if args.batch_size < 1:
        raise UserError(f"--batch-size: must be >= 1 (got {args.batch_size})")
    try:
        sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    except ValueError as e:
        raise UserError(f"--{str(e).split(':')[0].replace('_', '-')}: {str(e).split(': ', 1)[1]}") from None
    m = load(args.ckpt, args.device)
    res = generate(m, _prompts(args, m), sampling, args.batch_size)
    for g in res.generations:
        print(f"{g.name}: {g.prompt}{g.text}")
        if g.reference:
            print(f"  reference: {g.reference}")
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(asdict(g)) + "\n" for g in res.generations)
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write: {e.strerror or e}") from None
    print(checkpoint_line(args.ckpt, m.path), file=sys.stderr)
    print(f"{len(res.generations)} prompt(s), {res.new_tokens} new tokens in {res.seconds:.2f} s "
          f"({res.new_tokens / max(res.seconds, 1e-9):.1f} tokens/s); KV cache "
          f"{res.cache_bytes_per_token:,.0f} bytes/token", file=sys.stderr)
    return 0
