"""Block recomputation: what runs a block again in backward instead of keeping what it saved.

``Recompute()`` on one block is ``torch.utils.checkpoint``'s non-reentrant recomputation (driven from
``torchckpt.api``); the runtimes here extend it: ``selective.py`` keeps chosen ops' outputs (``Recompute(save=...)``,
NOTE [ Selective recompute ]), ``parts.py`` recomputes a block in parts (``Recompute(parts=...)``, NOTE
[ Recompute in parts ]), ``reentrant.py`` runs a block's forward without grad in one autograd node
(``Recompute(reentrant=True)``, NOTE [ Reentrant recompute ]), ``chain.py`` rebuilds a chain's block inputs from a
few snapshots by Revolve (``checkpoint_chain``, NOTE [ Chain of blocks ]), ``forward_state.py`` captures and replays
what a forward ran under (RNG, autocast, device), and ``mutation.py`` refuses to run again a forward that changed
state (NOTE [ Mutating forwards ]). Snapshots off the GPU go through the stores (``torchckpt.store``); nothing in ``store`` imports this
package.
"""
from torchckpt.recompute.chain import ChainStats

__all__ = ["ChainStats"]
