"""``bytediet optimize``: measure, apply techniques one at a time under an accuracy budget, recommend."""
