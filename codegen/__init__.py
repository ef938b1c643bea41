"""Turns (traced fx graph, Plan) into one GraphModule per rank."""
