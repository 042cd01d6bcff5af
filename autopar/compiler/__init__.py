"""The compiler driver: runs the stages for one rank (`driver`), prices the result (`pricing`), and
runs the compiler for the mesh choice (`auto_mesh`), the fixed comparison plans (`fixed`) and the
rule-coverage check (`coverage`)."""
