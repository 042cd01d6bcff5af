"""The vocabulary every layer shares: placements and layouts, the mesh, rule call types, the plan,
node metadata, the graph's collectives, and the errors users see."""
