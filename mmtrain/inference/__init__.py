"""Inference: a trained model at work outside training -- loaded from a checkpoint or an export,
prompted as training lays documents out, decoded with the KV cache of models/inference/; and its
Hugging Face form (`export --hf`), whose parity check decodes with both, so it sits here, above
mmtrain/state/ (the plain export) rather than in it.

    loading.py          load_model: config, weights and tokenizer from a run, checkpoint or export
    prompts.py          image/video files, shard samples, JSONL -> documents as training builds them
    generate.py         `mmtrain generate`: greedy or sampled text, batched prompts
    export_hf.py        `mmtrain export --hf`: weights, config, processor and mmtrain/hf/ as remote code
    hf_card.py          the exported folder's model card
    hf_parity.py        transformers against mmtrain on the same prompts (the card's figures)
    lmms_eval_model.py  lmms-eval's `mmtrain` model on an export (the `lmms_eval.models` entry point)
"""
