"""Verify admission for pdflash: a 2-D budget (verify tokens and expert bytes in flight), fair across sessions."""
