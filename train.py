"""Train a sparsekv gating head on a frozen causal LM.

    python train.py --config configs/train/tiny-cpu.yaml [key=value ...] [--push_to_hub user/repo]
    accelerate launch --config_file configs/accelerate/ddp_cpu.yaml train.py --config ...

`python train.py --help` lists every config key. The work happens in train/loop.py.
"""

import sys

from train.loop import main

if __name__ == "__main__":
    main(sys.argv[1:])
