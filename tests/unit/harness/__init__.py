"""Tests of moepass/harness/ (a package so that its test modules cannot collide by name with others)."""
