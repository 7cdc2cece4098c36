"""The IR: immutable nodes, edges and the training DAG, filters over tags, schedule actions,
the one list of kinds, and the text forms that round-trip."""
