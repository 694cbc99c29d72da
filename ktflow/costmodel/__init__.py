"""What things cost: hardware profiles, the roofline cost of a node, the memory model, routing curves."""
