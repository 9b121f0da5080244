#!/usr/bin/env python
"""Train the memory of a TitansQwen (BABILong or token stores); the same entry as `titans-hf train`.

    python scripts/train.py --model_name_or_path Qwen/Qwen2.5-0.5B --data_files qa1/32k.json
    accelerate launch --config_file titans_hf/accelerate/fsdp.yaml scripts/train.py ... --bf16
    accelerate launch --config_file titans_hf/accelerate/cpu_ddp.yaml scripts/train.py ...

Flags: `--help`, or one .json/.yaml file holding them (titans_hf/commands/train.py); logic:
titans_hf/training/recipe.py.
"""

import sys

from titans_hf.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
