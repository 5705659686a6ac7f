"""Decentralized (gossip) training's pure pieces: the graphs workers mix over (``topology``) and the
compressed mixing step every node takes with its neighbours (``choco``) and what a node keeps between
rounds (``node``). Nothing here touches the network."""
