"""What a replay assumes, and how it is checked: the model's state at capture and the check before every
replay, the state a model holds besides its parameters, the classification of arguments, and the typed
reasons a call runs without graphs (docs/replay-assumptions.md, docs/fallbacks.md)."""
