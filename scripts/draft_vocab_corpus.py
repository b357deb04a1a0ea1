"""Corpus for the shipped head's token_counts.safetensors: the target's own greedy answers (SmolLM2-135M-Instruct,
200 tokens, batches of 32) to aerie's built-in training prompts (services/train/prompts.py; NOT Spec-Bench).

    PYTHONPATH=. python scripts/draft_vocab_corpus.py START COUNT      # writes /tmp/sm/corpus/answers-*.txt
    aerie draft-vocab --from /tmp/sm/corpus/*.txt --out services/heads/smollm2-135m-eagle/token_counts.safetensors

The shipped file counts the answers to the first 256 prompts (38,007 tokens, 2,955 distinct ids); ids never
seen rank after the seen ones by ascending id (BPE merge order), see services/model/draft_vocab.py.
"""
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from services.model.loading import converted_gguf_dir, find_default_gguf
from services.train.prompts import default_prompts
from pathlib import Path
torch.set_num_threads(1)
d = converted_gguf_dir(Path(find_default_gguf()))
tok = AutoTokenizer.from_pretrained(str(d)); tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
prompts = default_prompts(0)
start, n, bs = int(sys.argv[1]), int(sys.argv[2]), 32
out = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/sm/corpus"); out.mkdir(parents=True, exist_ok=True)
for b in range(start, start + n, bs):
    batch = prompts[b:b + bs]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    t = time.time()
    with torch.no_grad():
        g = model.generate(**enc, max_new_tokens=200, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    ans = tok.batch_decode(g[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    (out / f"answers-{b:05d}.txt").write_text("\n\n".join(ans))
    print(b, len(prompts), time.time() - t, flush=True)
