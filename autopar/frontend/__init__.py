"""Front end: an nn.Module and one example batch -> a TracedGraph (ATen fx graph, blocks, batch dims)."""
