"""The plan choice: which Strategy each op gets (greedy, search and its seeds, fixed schemes), under
which memory, on which mesh, with how many batch chunks. It reads traced graphs and returns a
`Plan`; the driver hands that to the stages."""
