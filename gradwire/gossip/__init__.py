"""Decentralized (gossip) training's pure pieces: the graphs workers mix over (``topology``) and the
compressed mixing step every node takes with its neighbours (``choco``). Nothing here touches the network."""
