#!/usr/bin/env bash
# One command: install memfit and embed the bundled sample corpus with the bundled default model.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_memfit ""
rm -rf out/sample
memfit embed samples/sample.jsonl --id-field id --tokens -o out/sample
python - <<'PY'
import memfit
out = memfit.read("out/sample")
print(f"{len(out.ids)} texts -> embeddings {out.embeddings.shape}; "
      f"token rows of {out.ids[10]}: {out.token_embeddings[10].shape}")
PY
