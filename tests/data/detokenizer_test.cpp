// The zero-shot evaluation detokenizers (data/detokenizer.h) on WikiText-103 / Penn Treebank style
// lines, each rule worked by hand: headings, number separators, punctuation spacing, brackets and
// quotes tightened pairwise, the degree sign, " N ", possessives; an unmatched bracket or quote
// stays as it is; the path picks the detokenizer as Megatron's get_detokenizer.
#include <gtest/gtest.h>

#include <string>

#include "data/detokenizer.h"

namespace mt::data {
namespace {

TEST(WikitextDetokenizer, HeadingsAndNumberSeparators) {
  EXPECT_EQ(wikitext_detokenize(" = Valkyria Chronicles III = \n"), " = Valkyria Chronicles III =\n");
  EXPECT_EQ(wikitext_detokenize(" = = Gameplay = = \n"), " == Gameplay ==\n");
  EXPECT_EQ(wikitext_detokenize(" = = = = Sub = = = = \n"), " ==== Sub ====\n");
  EXPECT_EQ(wikitext_detokenize(" The game 's 1 @,@ 000 units sold in 2 @.@ 5 days ; it was well @-@ received . \n"),
            " The game's 1,000 units sold in 2.5 days; it was well-received.\n");
}

TEST(WikitextDetokenizer, PunctuationBracketsAndQuotes) {
  EXPECT_EQ(wikitext_detokenize(" He said \" hello world \" and ( in brackets ) , [ one ] { two } ! Really ? Yes : no . \n"),
            " He said \"hello world\" and (in brackets), [one] {two}! Really? Yes: no.\n");
  // each opening character pairs with the next closing one; "( )" empties
  EXPECT_EQ(wikitext_detokenize("a ( b ( c ) d ) e (  )"), "a (b ( c) d ) e ()");
  EXPECT_EQ(wikitext_detokenize("x ' y ' z ' w"), "x 'y' z ' w");
  // no closing character: unchanged
  EXPECT_EQ(wikitext_detokenize(" odd ( open without close and a ' lone quote \n"),
            " odd ( open without close and a ' lone quote\n");
}

TEST(WikitextDetokenizer, DegreesNumbersPossessives) {
  EXPECT_EQ(wikitext_detokenize(" the players ' scores were 12 \xC2\xB0 C . The N value \n"),
            " the players' scores were 12\xC2\xB0" "C. The 1 value\n");
  EXPECT_EQ(wikitext_detokenize("\n line\n"), "\nline\n");
  EXPECT_EQ(wikitext_detokenize(" path /' 5/ end"), " path /'[0-9]/ end");  // Megatron's literal pattern
  EXPECT_EQ(wikitext_detokenize(""), "");
}

TEST(PtbDetokenizer, Rules) {
  EXPECT_EQ(ptb_detokenize("it does n't cost $ 1 or # 1 , the N rule 's \n next"),
            "it doesn't cost $1 or #1 , the1 rule's\nnext");
}

TEST(Detokenizer, ChosenByThePath) {
  EXPECT_STREQ(detokenizer_for("/data/wikitext-103/wiki.test.tokens"), "wikitext");
  EXPECT_STREQ(detokenizer_for("ptb.test.txt"), "ptb");
  EXPECT_STREQ(detokenizer_for("lambada_test.jsonl"), "lambada");
  EXPECT_STREQ(detokenizer_for("my_text.txt"), "");
  EXPECT_STREQ(detokenizer_for("ptb_wiki.txt"), "ptb");  // the first key found, in Megatron's order
  EXPECT_EQ(detokenize_for("wiki.txt", "a @-@ b"), "a-b");
  EXPECT_EQ(detokenize_for("plain.txt", "a @-@ b"), "a @-@ b");
  EXPECT_EQ(detokenize_for("lambada.jsonl", "a @-@ b"), "a @-@ b");
}

}  // namespace
}  // namespace mt::data
