from torchstrategies_cli import main

main(prog_name="torchstrategies")
