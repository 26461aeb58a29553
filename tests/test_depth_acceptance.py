"""loadtest/depth_acceptance.py: the per-depth counts, and a smallest run end to end."""
import re

from loadtest import depth_acceptance


def test_depth_rows_count_each_draft_up_to_its_first_rejection():
    # 3 drafted, all accepted: depths 1-3 reached and accepted; 3 drafted, first rejected: depth 1 reached;
    # 2 drafted, the first accepted: depths 1-2 reached, depth 1 accepted
    assert depth_acceptance.depth_rows([(3, 3), (3, 0), (2, 1)]) == [[3, 2, 1], [2, 1, 1]]
    assert depth_acceptance.per_position([(3, 3), (3, 0), (2, 1)]) == (3 + 0 + 1) / (3 + 1 + 2)


def test_every_method_drafts_its_full_k_and_each_depth_is_reached_only_through_the_one_before(capsys):
    results = depth_acceptance.main(["--methods", "ngram,eagle3", "--sets", "prose", "--temperatures", "0",
                                     "--num-prompts", "1", "--new-tokens", "12", "--rounds", "1", "--k", "4",
                                     "--by-prompt"])
    assert re.search(r"prompt 0 \(\d+ tokens\): ngram \d\.\d\d eagle3 \d\.\d\d", capsys.readouterr().out)
    assert set(results) == {("prose", 0.0, "ngram"), ("prose", 0.0, "eagle3")}
    reached, accepted = results[("prose", 0.0, "eagle3")]
    assert reached[0] > 0 and len(reached) <= 4
    assert all(0 <= a <= r for a, r in zip(accepted, reached))
    assert all(r_next <= a for r_next, a in zip(reached[1:], accepted))     # reached d + 1 only if d accepted
