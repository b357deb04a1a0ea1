"""The draft head's kind, the one type for it wherever it is passed (checkpoints, training, the CLI).

    "eagle"   EAGLE-1/2: reads the target's post-norm last hidden state (feature kind "hidden")
    "eagle3"  EAGLE-3: reads three layer taps, concatenated (feature kind "taps")

No torch here, so that argument parsers can name the choices without loading the model code.
"""

from __future__ import annotations

from typing import Literal, get_args

HeadKind = Literal["eagle", "eagle3"]
HEAD_KINDS: tuple[HeadKind, ...] = get_args(HeadKind)  # argparse choices, in this order
