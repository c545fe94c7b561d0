"""lmms-eval's `mmtrain` model: an `mmtrain export --hf` folder, scored by lmms-eval.

    pip install lmms-eval        # its own environment: it pulls its own torch build
    python -m lmms_eval --model mmtrain --model_args pretrained=EXPORT_DIR --tasks TASK

Registered through the `lmms_eval.models` entry point (pyproject.toml): it imports transformers
and lmms-eval, never the rest of mmtrain, so the export folder plus this file are all it needs.
Images go where the context has `<|image_pad|>`, else before it (one each); each request is
one prompt (batch 1), greedy unless the task's gen_kwargs ask otherwise, cut at the task's
`until` strings. Videos, multi-round chat: one clear error.
"""

from __future__ import annotations

import torch
from lmms_eval.api.model import lmms
from transformers import AutoModelForImageTextToText, AutoProcessor

IMAGE = "<|image_pad|>"


def manifest():
    """The entry point's payload: lmms-eval's registration of this model."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest("mmtrain", simple_class_path="mmtrain.inference.lmms_eval_model.MmtrainLMM")


class MmtrainLMM(lmms):
    is_simple = True

    def __init__(self, pretrained: str, device: str = "cpu", max_new_tokens: int = 64, **kwargs) -> None:
        super().__init__()
        self.processor = AutoProcessor.from_pretrained(pretrained, trust_remote_code=True)
        model = AutoModelForImageTextToText.from_pretrained(pretrained, trust_remote_code=True)
        self.device, self.max_new_tokens = torch.device(device), max_new_tokens
        self.model = model.to(self.device).eval()

    def _doc(self, req):
        """(context, target or its function, the request's images)."""
        context, target, doc_to_visual, doc_id, task, split = req.args
        doc = self.task_dict[task][split][doc_id]
        visuals = doc_to_visual(doc) if doc_to_visual is not None else []
        flat = [v for group in visuals for v in (group if isinstance(group, list) else [group])]
        if any(not hasattr(v, "convert") for v in flat):
            raise ValueError("mmtrain's lmms-eval model takes images (PIL); for videos use the processor")
        return context, target if isinstance(target, str | dict) or target is None else target(doc), flat

    def _inputs(self, context: str, images: list):
        text = context if IMAGE in context or not images else IMAGE * len(images) + context
        return self.processor(images=images or None, text=text, return_tensors="pt").to(self.device)

    @torch.no_grad()
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return [self._score(*self._doc(req)) for req in requests]

    def _score(self, context: str, continuation: str, images: list) -> tuple[float, bool]:
        """(summed log-probability of the continuation's tokens, whether greedy decoding gives them)."""
        inputs = self._inputs(context, images)
        cont_1C = torch.tensor([self.processor.tokenizer(continuation, add_special_tokens=False).input_ids],
                               device=self.device)
        ids_1S = torch.cat([inputs["input_ids"], cont_1C], 1)
        media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        logits = self.model(input_ids=ids_1S, attention_mask=torch.ones_like(ids_1S), **media).logits
        logp_CV = logits[0, -cont_1C.shape[1] - 1:-1].float().log_softmax(-1)
        hit = bool((logp_CV.argmax(-1) == cont_1C[0]).all())
        return float(logp_CV.gather(-1, cont_1C[0, :, None]).sum()), hit

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        return [self._generate(*self._doc(req)) for req in requests]

    def _generate(self, context: str, gen_kwargs: dict | None, images: list) -> str:
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        temperature = gen_kwargs.get("temperature", 0.0)
        sampling = {"do_sample": temperature > 0, **({"temperature": temperature} if temperature > 0 else {})}
        inputs = self._inputs(context, images)
        new = gen_kwargs.get("max_new_tokens", self.max_new_tokens)
        ids = self.model.generate(**inputs, max_new_tokens=new, **sampling)[:, inputs["input_ids"].shape[1]:]
        text = self.processor.batch_decode(ids, skip_special_tokens=True)[0]
        for stop in [until] if isinstance(until, str) else until:
            text = text.split(stop)[0]
        return text

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError("mmtrain's lmms-eval model: multi-round chat is not supported")
