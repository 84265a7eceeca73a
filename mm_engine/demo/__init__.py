"""The demo model shipped in the package (`demo_model/`) and the scenes it is trained and evaluated
on (`scenes`)."""
