from mmtrain.attention_maps.cli import main

raise SystemExit(main())
