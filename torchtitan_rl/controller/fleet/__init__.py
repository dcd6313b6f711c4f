"""The generator fleet as the controller sees it: spawned, routed, given new weights (the push
chosen and run here), and a lost generator replaced."""
