"""What a compile shows a person: the plan summary, debug dumps of every stage, rule coverage and
pictures of the modeled timeline."""
